# Two set-up commands for a fresh machine with Python >= 3.11 and make:
#   make serve   -> .venv, install, fetch the default model, start the server on 127.0.0.1:8000
#   make test    -> .venv with the test extra, run the whole suite, then the kernel tests again
#                   at each lesser CPU level this machine runs (JAXBATCH_CPU_LEVEL=avx2, ...)
#   make lint    -> ruff and mypy (pyproject's [tool.ruff] and [tool.mypy]); CI runs it first
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: serve test install install-test lint bench plan

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/jaxbatch build-kernels

install-test: $(BIN)/python
	$(BIN)/pip install -q -e ".[test,dev]"

serve: install
	$(BIN)/jaxbatch serve --config configs/smollm2-cpu.yaml --host 127.0.0.1 --port 8000

test: install-test
	$(BIN)/python -m pytest tests
	$(BIN)/python -m tests.run_levels

lint: install-test
	$(BIN)/ruff check jaxbatch pallas_kernels tests scripts
	$(BIN)/mypy

bench: install-test
	$(BIN)/python scripts/bench_throughput.py

plan: install
	$(BIN)/jaxbatch plan benchmarks/workloads/bench64.jsonl
