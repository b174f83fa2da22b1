# Two entry points: `make run` (the gateway in front of a simulated fleet) and
# `make test`. Each installs what it needs into .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test test-slow test-all system-deps lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/igw up

# Debian packages the slow suites use (real Prometheus server, Docker engine).
system-deps:
	@bash .ci/system-deps

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) system-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP) system-deps
	$(BIN)/python -m pytest -m "slow" $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-all: test test-slow

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench,peers]'
	$(BIN)/igw bench --scenario all

clean:
	rm -rf $(VENV) build *.egg-info
