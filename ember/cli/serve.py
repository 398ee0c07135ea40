"""`ember serve` (being built)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("serve", help="(being built)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    raise SystemExit("ember serve: not built yet")
