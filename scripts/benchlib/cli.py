"""Command-line pieces the benchmark scripts share: quick/full defaults, list flags, outputs."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def fill_defaults(args: argparse.Namespace, quick: Mapping[str, Any], full: Mapping[str, Any]
                  ) -> None:  # fmt: skip
    """Flags left unset take the ``--quick`` or the full run's value."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def names(ap: argparse.ArgumentParser, flag: str, text: str, known: Iterable[str]) -> list[str]:
    """A comma list of names, each one of ``known`` (else the parser's usage error)."""
    known = sorted(known)
    got = [x for x in text.split(",") if x]
    unknown = [x for x in got if x not in known]
    if unknown:
        ap.error(f"{flag}: unknown {unknown}; choose from {known}")
    return got


def write_outputs(result: dict, json_path: str | None, plot_path: str | None,
                  plot: Callable[[dict, str], None]) -> None:  # fmt: skip
    """``--json`` and ``--plot``, where asked for."""
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=2)
    if plot_path:
        plot(result, plot_path)
