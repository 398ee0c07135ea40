"""`ember env build|status`: the node's environments (virtualenvs for runtimes that cannot share ember's)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("env", help="build and inspect the node's runtime environments (e.g. vllm)")
    parser.add_argument("--root", type=Path, default=None,
                        help="where environments live (default: $EMBER_ENV_ROOT, else envs/ under the state dir)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = actions.add_parser("build", help="build an environment from the requirements list ember ships")
    build.add_argument("name", help="the environment (known: see `ember env status`)")
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    build.set_defaults(func=_build)
    status = actions.add_parser("status", help="each known environment: built, or why not")
    status.set_defaults(func=_status)


def _build(args: argparse.Namespace) -> int:
    from ember.environments.build import build
    from ember.environments.registry import Environments

    envs = Environments(args.root)
    if args.quiet:
        path = build(envs, args.name)
    else:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        columns = (SpinnerColumn(), TextColumn("{task.description}"), TextColumn("[dim]{task.fields[packages]} "
                                                                                  "packages"), TimeElapsedColumn())
        with Progress(*columns) as progress:
            task = progress.add_task(f"{args.name}: start", total=None, packages=0)

            def report(what: str, packages: int) -> None:
                progress.update(task, description=f"{args.name}: {what}", packages=packages)

            path = build(envs, args.name, report)
    print(f"environment {args.name!r} built at {path}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from ember.environments.registry import Environments, known

    envs = Environments(args.root)
    for name in known():
        status = envs.status(name)
        print(f"{name}: {'built' if status.built else 'not built'} at {status.path}"
              + ("" if status.built else f" ({status.reason})"))
    print(_llama_cpu_backend())
    from ember.node.criu import find

    criu = find()
    print(f"snapshots (CRIU {criu.version}): available at {criu.path}" if criu.ok else
          f"snapshots: off ({criu.reason})")
    return 0


def _llama_cpu_backend() -> str:
    """The llama.cpp CPU backend variant this host loads, and each variant's score here (0: cannot run)."""
    try:
        from ember.runtimes import ggml_backends, llamacpp

        llamacpp.preload()
        chosen = ggml_backends.loaded()
    except Exception as err:   # reported, not raised: the rest of the status stands
        return f"llama.cpp CPU backend: cannot load ({err})"
    if chosen is None:
        return "llama.cpp CPU backend: not loaded"
    scores = ", ".join(f"{n} {s}" for n, s in chosen.scores)
    return f"llama.cpp CPU backend: {chosen.variant} ({chosen.reason})" + (f"; scores here: {scores}" if scores else "")
