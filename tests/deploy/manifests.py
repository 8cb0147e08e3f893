"""Rendering the kustomize trees (``kubectl kustomize``) into lists of Kubernetes objects."""

from __future__ import annotations

import functools

import yaml

from tests.deploy.tools import DEPLOY, require_tool, run_tool

K8S = DEPLOY / "k8s"
TREES = {"base": K8S / "base", "sim": K8S / "overlays" / "sim"}


@functools.cache
def _render(tree: str) -> tuple[str, str]:
    kubectl = require_tool("kubectl")
    result = run_tool([kubectl, "kustomize", str(TREES[tree])])
    return result.stdout, result.stderr if result.returncode else ""


def render(tree: str) -> list[dict]:
    """The objects ``kubectl kustomize`` builds from one tree (fails the test if it cannot)."""
    out, err = _render(tree)
    assert not err, f"kubectl kustomize {tree}: {err}"
    return [d for d in yaml.safe_load_all(out) if d]


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    """The one object of ``kind`` (and ``name``)."""
    hits = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(hits) == 1, f"{kind} {name}: {len(hits)} found"
    return hits[0]


def container(deployment: dict, name: str) -> dict:
    """A container of a Deployment's pod template by name."""
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"{deployment['metadata']['name']}: no container {name}")


def mounts(c: dict) -> dict[str, str]:
    """Volume name -> mount path of a container."""
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
