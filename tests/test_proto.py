"""proto/ is generated from kvxferd.wire and the API route tables and must never drift from them."""

import importlib.util
import json
from pathlib import Path

import pytest

from kvxferd import wire
from kvxferd.api import engine, peer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rendered(gen_proto):
    return gen_proto.render()


def test_every_generated_file_is_checked_in_unchanged(rendered):
    expected = {"schemas/Manifest.json", "schemas/Ticket.json", "schemas/versions.json",
                "openapi/engine.json", "openapi/peer.json", "README.md"}  # fmt: skip
    assert expected <= set(rendered)
    stale = [rel for rel, text in rendered.items() if _read(rel) != text]
    assert stale == [], f"run scripts/gen_proto.py; stale: {stale}"


def test_the_check_mode_agrees(gen_proto, capsys):
    assert gen_proto.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_no_orphan_files(rendered):
    on_disk = {str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.*")}
    assert on_disk <= set(rendered), f"remove stale files: {sorted(on_disk - set(rendered))}"


def test_every_field_of_every_message_is_documented(rendered):
    undocumented = []
    for rel, text in rendered.items():
        if not rel.startswith("schemas/"):
            continue
        for name, comp in json.loads(text).get("$defs", {}).items():
            for field, prop in comp.get("properties", {}).items():
                is_tag = field == "type" and len(prop.get("enum", [])) == 1
                if not prop.get("description") and not is_tag:
                    undocumented.append(f"{name}.{field}")
    assert undocumented == []


def test_the_openapi_files_are_the_documents_the_apps_serve(rendered):
    assert json.loads(rendered["openapi/engine.json"]) == engine.engine_document()
    assert json.loads(rendered["openapi/peer.json"]) == peer.peer_document()


def test_the_readme_lists_every_route_and_carries_the_wire_rules(rendered):
    readme = rendered["README.md"]
    for op in [*engine.OPERATIONS, *peer.OPERATIONS]:
        assert f"| {op.method} | `{op.path}` |" in readme, op.path
    addressing = next(p for p in wire.__doc__.split("\n\n") if p.startswith("Byte addressing"))
    assert " ".join(addressing.split()) in " ".join(readme.split())
    assert f"Manifest version {wire.MANIFEST_VERSION}" in readme
    for word in ("hold", "ticket", "claim", "READ", "notification", "release", "ErrorBody",
                 "KVX1", "WWW-Authenticate", "replay window", "rotation",
                 "never goes on the wire"):  # fmt: skip
        assert word in readme, word


def _read(rel: str) -> str | None:
    path = ROOT / "proto" / rel
    return path.read_text() if path.exists() else None


def test_the_readme_shows_the_signature_line_separator_as_an_escape(rendered):
    assert "joined by `\\n`." in rendered["README.md"]
