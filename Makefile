# Fresh machine: `make demo` or `make test`. Both create .venv idempotently.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export UCX_NET_DEVICES ?= lo

.PHONY: setup tools vllm-venv test test-vllm lint format demo clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	touch $(STAMP)

setup: $(STAMP)

# promtool for tests/deploy; best effort on a dev machine (those tests then skip, saying why),
# required under CI (KVXFERD_REQUIRE_TOOLS=1).
tools:
	@scripts/install-promtool.sh || { [ -z "$$KVXFERD_REQUIRE_TOOLS" ] && echo "promtool unavailable: tests/deploy will skip its checks"; }

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# .venv-vllm: vLLM 0.33.0 (CPU-usable parts) beside kvxferd for tests/vllm; idempotent (stamp).
vllm-venv:
	scripts/vllm-venv.sh

test: lint tools vllm-venv
	$(VENV)/bin/pytest
	$(MAKE) test-vllm

# tests/vllm need vllm, so they run in .venv-vllm (the main run skips them, saying why).
test-vllm: vllm-venv
	KVXFERD_REQUIRE_TOOLS=1 .venv-vllm/bin/pytest -p no:cacheprovider tests/vllm

demo: setup
	$(VENV)/bin/kvxferd demo

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache .ruff_cache build *.egg-info
