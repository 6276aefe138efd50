# rlbus — the two commands are `make demo` and `make test`; both set up .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: demo test test-slow bench clean

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

bench: $(VENV)
	@for f in bench/*.py; do case $$f in */__init__.py) ;; *) echo "== $$f"; $(BIN)/python $$f || exit 1;; esac; done

clean:
	rm -rf $(VENV) runs .pytest_cache
