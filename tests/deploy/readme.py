"""The configuration table of deploy/README.md, generated from the code that defines it.

``python -m tests.deploy.readme`` rewrites the block between the markers; the tests check it is
current, so a new setting cannot ship undocumented.
"""

from __future__ import annotations

import argparse
import dataclasses

from kvxferd.cli import _parser
from kvxferd.config import ENV_PREFIX, Config, env_help
from tests.deploy.tools import DEPLOY

README = DEPLOY / "README.md"
BEGIN = "<!-- BEGIN serve-config (generated: python -m tests.deploy.readme) -->"
END = "<!-- END serve-config -->"
# Flags whose value is not a Config field of the same name.
_FLAG_FIELD = {"peer_token_file": "peer_token", "peer_token_previous_file": "peer_token_previous"}


def serve_flags() -> dict[str, str]:
    """Config field -> the ``kvxferd serve`` flag that sets it."""
    root = _parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for action in sub.choices["serve"]._actions:
        if action.option_strings and action.dest != "help":
            out[_FLAG_FIELD.get(action.dest, action.dest)] = action.option_strings[0]
    return out


def config_table() -> str:
    """Markdown table: env var, flag, default, meaning, one row per Config field."""
    flags = serve_flags()
    docs = dict(env_help())
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    rows = ["| Environment variable | Flag | Default | Meaning |", "| --- | --- | --- | --- |"]
    for name, default in defaults.items():
        env = ENV_PREFIX + name.upper()
        flag = flags.get(name, "")
        flag_cell = f"`{flag}`" if flag else "-"
        shown = f"`{default}`" if default != "" else "(empty)"
        if name == "peer_token":
            flag_cell, shown = f"`{flag} PATH` (the file's content)", "(required)"
        elif name == "peer_token_previous":
            flag_cell = f"`{flag} PATH` (the file's content)"
        elif isinstance(default, tuple):
            shown = f"`{','.join(default)}`"
        rows.append(f"| `{env}` | {flag_cell} | {shown} | {docs[env]} |")
    return "\n".join(rows)


def expected_block() -> str:
    return f"{BEGIN}\n{config_table()}\n{END}"


def main() -> None:
    text = README.read_text(encoding="utf-8")
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    README.write_text(text[:start] + expected_block() + text[stop:], encoding="utf-8")


if __name__ == "__main__":
    main()
