# Two commands after cloning: `make run` (the demo) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The bench's extra (FastStream, the peer), installed only by `make bench`, after the dev one.
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: run test lint typecheck check bench dev-up dev-down clean constraints wheels

# The library and its pipeline from packages/ (editable: a change there is live), then the
# example service with its dev tools; every version as constraints.txt pins it.
LIBRARY := packages/reliable-consumer
PIPELINE := packages/reliable-consumer-pipeline

$(STAMP): pyproject.toml $(LIBRARY)/pyproject.toml $(PIPELINE)/pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '$(LIBRARY)[postgres,console,devstack,testing,otel,avro]' -e $(PIPELINE) -e '.[dev]'
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[bench]'
	touch $(BENCH_STAMP)

run: $(STAMP)  ## the worker on the embedded broker and Redis, on sample records for every bound handler
	$(BIN)/service demo

# The suite mostly waits (sessions expiring, brokers electing, outages running out), so it
# runs on more workers than cores; TEST_WORKERS=0 runs it in this process, one test at a time.
TEST_WORKERS ?= 3

test: $(STAMP)  ## every test: units, real-server integration, chaos (bounded), pipeline, deploy
	$(BIN)/pytest -n $(TEST_WORKERS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

bench: $(BENCH_STAMP)  ## every bench row (docs/performance.md); more: make bench ARGS="--rows latency --rounds 5"
	$(BIN)/python -m bench $(ARGS)

dev-up: $(STAMP)
	$(BIN)/service dev up

dev-down: $(STAMP)
	$(BIN)/service dev down

# The engine's wheels for the example's Docker build (a generated service keeps its own).
wheels: $(STAMP)
	$(BIN)/pip wheel --quiet --no-deps --wheel-dir wheels $(LIBRARY) $(PIPELINE)

# constraints.txt: every installed distribution at the version the suite last passed with.
# Regenerate after changing a dependency range, then run `make test`.
constraints:
	{ echo '# Every distribution the suite last passed with (make constraints regenerates it).'; \
	  $(BIN)/pip freeze --exclude-editable | grep -v '^-e '; } > constraints.txt

clean:
	-$(BIN)/service dev down --purge 2>/dev/null
	rm -rf $(VENV) .devstack .pytest_cache .mypy_cache .ruff_cache
