# Entry points for a fresh machine: `make demo` runs the agent on a simulated GPU node,
# `make test` runs the checks and the tests. Both set up .venv and build vcuda/ first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench build clean proto

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

build: $(VENV)/.installed
	$(MAKE) -C vcuda PYTHON=$(abspath $(PY))

demo: build
	$(PY) -m gpumanager.testing.demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check gpumanager tests bench scripts
	$(VENV)/bin/ruff format --check gpumanager tests bench scripts
	$(VENV)/bin/mypy

test: build lint
	$(VENV)/bin/pytest

bench: build
	$(PY) bench/bench_registration.py

proto: $(VENV)/.installed
	$(PY) scripts/gen_proto.py

clean:
	$(MAKE) -C vcuda clean
