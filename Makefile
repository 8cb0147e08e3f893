# Fresh machine: `make demo` or `make test`. Both create .venv idempotently.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export UCX_NET_DEVICES ?= lo

.PHONY: setup test lint format demo clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(VENV)/bin/pytest

demo: setup
	$(VENV)/bin/kvxferd demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
