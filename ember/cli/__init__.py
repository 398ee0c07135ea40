"""The `ember` command line: serve, status, sim, store, env, keys and cluster, each in a module of its own."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ember.errors import EmberError

# Each module defines `register(subparsers)`; its command imports heavy libraries lazily.
COMMANDS = ("serve", "status", "sim", "store", "env", "keys", "cluster")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="Serverless inference with warm cold starts.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"ember.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EmberError as err:
        print(f"ember: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
