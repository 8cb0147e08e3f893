"""proto/ is generated from kvxferd.wire and must never drift from it."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_wire_struct_has_a_checked_in_schema_equal_to_the_generated_one():
    rendered = _gen_proto().render()
    assert "schemas/Manifest.json" in rendered and "schemas/Ticket.json" in rendered
    stale = [rel for rel, text in rendered.items() if (ROOT / "proto" / rel).read_text() != text]
    assert stale == [], f"run scripts/gen_proto.py; stale: {stale}"


def test_no_orphan_schema_files():
    rendered = _gen_proto().render()
    on_disk = {str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.json")}
    assert on_disk <= set(rendered), f"remove stale files: {sorted(on_disk - set(rendered))}"


def test_every_field_of_every_message_is_documented():
    rendered = _gen_proto().render()
    import json

    undocumented = []
    for text in rendered.values():
        for name, comp in json.loads(text).get("$defs", {}).items():
            for field, prop in comp.get("properties", {}).items():
                is_tag = field == "type" and len(prop.get("enum", [])) == 1
                if not prop.get("description") and not is_tag:
                    undocumented.append(f"{name}.{field}")
    assert undocumented == []
