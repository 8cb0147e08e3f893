"""The import direction only points down the layers of DESIGN.md / README's code map.

Every ``kvxferd`` module is parsed (no import side effects) and each ``import``/``from`` of a
kvxferd module must name a layer at or below its own. Only the transport imports nixl; the pure
layers import no I/O or networking modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvxferd"

# Longest prefix wins.
LAYERS: dict[str, int] = {
    "kvxferd": 0,
    "kvxferd.wire": 0,
    "kvxferd.errors": 0,
    "kvxferd.config": 0,
    "kvxferd.layout": 1,
    "kvxferd.descriptors": 2,
    "kvxferd.memory": 3,
    "kvxferd.transport": 4,
    "kvxferd.store": 4,
    "kvxferd.metrics": 5,
    "kvxferd.pattern": 5,
    "kvxferd.sidecar": 5,
    "kvxferd.api": 6,
    "kvxferd.calls": 6,
    "kvxferd.client": 6,
    "kvxferd.frameconn": 5,
    "kvxferd.lanes": 6,
    "kvxferd.sim": 7,
    "kvxferd.proxy": 7,
    "kvxferd.vllm": 7,
    "kvxferd.demo": 7,
    "kvxferd.cli": 7,
    "kvxferd.commands": 7,
    "kvxferd.__main__": 7,
}
PURE = ("kvxferd.layout", "kvxferd.descriptors")
NOT_IN_PURE = {"socket", "asyncio", "httpx", "subprocess", "threading", "nixl", "torch"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _imports(path: Path) -> list[str]:
    """Absolute module names imported anywhere in the file (TYPE_CHECKING blocks included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: use absolute imports (kvxferd.x), not relative ones"
            out.append(node.module or "")
    return out


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_only_point_down(path):
    module = _module_name(path)
    mine = _layer(module)
    upward = [
        f"{name} (layer {_layer(name)})"
        for name in _imports(path)
        if name.startswith("kvxferd") and _layer(name) > mine
    ]
    assert upward == [], f"{module} (layer {mine}) imports upward: {upward}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_only_the_transport_imports_nixl_and_pure_layers_do_no_io(path):
    module = _module_name(path)
    roots = {name.split(".")[0] for name in _imports(path)}
    if not module.startswith("kvxferd.transport"):
        assert "nixl" not in roots, f"{module} imports nixl"
    if module.startswith(PURE):
        assert not roots & NOT_IN_PURE, f"{module} imports {sorted(roots & NOT_IN_PURE)}"


def test_every_module_has_a_layer():
    assert all(_layer(_module_name(p)) is not None for p in MODULES)
    assert len(MODULES) > 50


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_only_the_vllm_connector_imports_vllm(path):
    module = _module_name(path)
    roots = {name.split(".")[0] for name in _imports(path)}
    if not module.startswith("kvxferd.vllm"):
        assert "vllm" not in roots, f"{module} imports vllm (an optional extra)"
