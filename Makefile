# Two commands after cloning: `make run` (the demo) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck check bench dev-up dev-down clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)  ## the worker on the embedded broker and Redis, processing sample payments
	$(BIN)/service demo

test: $(STAMP)  ## every test: units, real-server integration, chaos (bounded), pipeline, deploy
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check service

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

bench: $(STAMP)
	$(BIN)/python -m bench.bench_worker

dev-up: $(STAMP)
	$(BIN)/service dev up

dev-down: $(STAMP)
	$(BIN)/service dev down

clean:
	-$(BIN)/service dev down 2>/dev/null
	rm -rf $(VENV) .devstack .pytest_cache .mypy_cache .ruff_cache
