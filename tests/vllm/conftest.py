"""tests/vllm run in .venv-vllm (scripts/vllm-venv.sh); elsewhere they skip, saying why."""

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import vllm  # noqa: F401
except ImportError:  # the main venv: `make test-vllm` runs these in .venv-vllm
    collect_ignore_glob = ["test_*.py"]

    def pytest_report_header() -> str:
        """Say why tests/vllm did not run here."""
        return "tests/vllm skipped: vllm is not installed here (make test-vllm runs them)"


CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def config_dir(name: str) -> str:
    """A tiny config.json of tests/vllm/configs."""
    return os.path.join(CONFIGS, name)


@pytest.fixture(scope="session")
def engines():
    """vLLM engine configs built once per (model, layout, blocks): {key: cpu.Engine}."""
    from kvxferd.vllm import cpu

    cache = {}

    def get(name: str, layout: str = "LBHNC", num_blocks: int = 24, **kw):
        key = (name, layout, num_blocks, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = cpu.build(config_dir(name), num_blocks=num_blocks, layout=layout, **kw)
        return cache[key]

    return get
