"""`ember store ls|push|pull|gc|stats`: the weight store from the command line."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.store import WeightStore

# the converted GGUF's weight types (ember.store.hf_convert.OUTTYPES, not imported with every command)
OUTTYPES = ("q8_0", "f16", "bf16", "f32", "auto")


def register(sub: Any) -> None:
    parser = sub.add_parser("store", help="push, pull and inspect model weights in the tiered weight store")
    parser.add_argument("--root", type=Path, default=None,
                        help="store root (default: $EMBER_STORE or ~/.cache/ember/store)")
    parser.add_argument("--origin", default=os.environ.get("EMBER_STORE_ORIGIN"),
                        help="http(s) or s3:// URL of a remote store root (default: $EMBER_STORE_ORIGIN)")
    parser.add_argument("--memory-dir", type=Path, default=None, help="memory tier directory (default: /dev/shm/...)")
    parser.add_argument("--no-memory", action="store_true", help="go without the memory tier")
    parser.add_argument("--memory-capacity", type=int, default=None, help="memory tier capacity in bytes")
    parser.add_argument("--keep-memory-tier", action="store_true",
                        help="leave the memory tier in RAM on exit if this command created it (default: remove it)")
    parser.add_argument("--disk-capacity", type=int, default=None, help="disk cache capacity in bytes")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    ls = actions.add_parser("ls", help="list models (with --origin, those the origin lists too)")
    ls.set_defaults(func=_ls)
    push = actions.add_parser("push", help="cut a model file or directory into chunks and store it")
    push.add_argument("path", type=Path)
    push.add_argument("name", help="name:version (version defaults to 'latest')")
    push.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bar")
    convert = push.add_mutually_exclusive_group()
    convert.add_argument("--gguf", action="store_true",
                         help="convert the directory to GGUF with llama.cpp's converter (the default for a "
                              "Hugging Face directory of a generative model: config.json names *ForCausalLM, ...)")
    convert.add_argument("--as-is", action="store_true", help="push a Hugging Face directory as it is, unconverted")
    push.add_argument("--outtype", default="q8_0", choices=OUTTYPES,
                      help="the converted GGUF's weight type (default: q8_0)")
    push.set_defaults(func=_push)
    pull = actions.add_parser("pull", help="fetch every chunk of a model into the local tiers")
    pull.add_argument("name")
    pull.add_argument("--to", type=Path, default=None, help="also write the model's files into this directory")
    pull.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bar")
    pull.set_defaults(func=_pull)
    gc = actions.add_parser("gc", help="drop unreferenced chunks and temp files left by dead processes")
    gc.add_argument("--verify", action="store_true", help="re-hash every chunk and drop corrupt ones")
    gc.set_defaults(func=_gc)
    stats = actions.add_parser("stats", help="tier usage and dedupe ratio")
    stats.set_defaults(func=_stats)


def _store(args: argparse.Namespace) -> WeightStore:
    from ember.store import StoreConfig, WeightStore

    values: dict[str, Any] = {"origin": args.origin, "keep_memory_tier": args.keep_memory_tier}
    if args.root is not None:
        values["root"] = args.root
    if args.no_memory:
        values["memory_dir"] = None
    elif args.memory_dir is not None:
        values["memory_dir"] = args.memory_dir
    for key in ("memory_capacity", "disk_capacity"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    return WeightStore(StoreConfig.build(**values))


@contextmanager
def _progress(args: argparse.Namespace, label: str, total: int) -> Iterator[Callable[[int], None]]:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  disable=args.quiet, transient=False) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _ls(args: argparse.Namespace) -> int:
    with _store(args) as store:
        for key in store.models(remote=True):
            print(key)
    return 0


def _push(args: argparse.Namespace) -> int:
    import time

    from ember.errors import InvalidInput
    from ember.store import ModelRef, hf_convert

    ModelRef.parse(args.name)
    if not args.path.exists():
        raise InvalidInput(f"push: {args.path} does not exist")
    with _store(args) as store:
        path = args.path   # a .gguf is pushed as it is: llama.cpp maps it from the node's copy
        if args.gguf or (not args.as_is and hf_convert.is_hf_dir(path)):
            # a Hugging Face directory, converted once (cached by content under the store root), then pushed
            started = time.perf_counter()
            path = hf_convert.convert(path, store.root / "converted", args.outtype, say=print)
            print(f"{path.name}: {_size(path.stat().st_size)} ({time.perf_counter() - started:.1f} s); pushing it")
        contracts = _contracts_in(path)
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        total = sum(p.stat().st_size for p in files)
        with _progress(args, f"push {args.name}", total) as advance:
            manifest = store.push(path, args.name, progress=advance)
    unique = len(manifest.unique_chunks())
    print(f"pushed {manifest.key}: {len(manifest.files)} files, {unique} chunks, {_size(manifest.logical_bytes)}")
    if contracts:
        print(f"contracts: {', '.join(contracts)} (serve them on any node: ember serve --models store:{manifest.key})")
    return 0


def _contracts_in(path: Path) -> list[str]:
    """The model contracts at the top of a directory being pushed (a contract directory: contract, code, weights),
    checked now rather than on the node that fetches them: a YAML file with a `runtime` key must be a valid
    contract, and its weights must lie inside the directory (another node has only what the store holds)."""
    import yaml

    from ember.errors import InvalidInput
    from ember.wire.contract import find_contracts, load_contract

    if not path.is_dir():
        return []
    keys = []
    for file in find_contracts(path):
        try:
            data = yaml.safe_load(file.read_text())
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(data, dict) or "runtime" not in data:
            continue   # not a contract (a model's own config file)
        contract = load_contract(file)
        own = contract.weights and contract.store_ref is None and not contract.weights.startswith("pkg:")
        weights = contract.weights_path() if own else None   # pkg: is in the image; store: in the store
        if weights is not None and not weights.resolve().is_relative_to(path.resolve()):
            raise InvalidInput(f"push: {file.name}: weights {contract.weights!r} lie outside {path}; another node "
                               "would not have them (put them in the directory, or push them and use store:NAME)")
        keys.append(contract.key)
    return keys


def _pull(args: argparse.Namespace) -> int:
    import shutil

    with _store(args) as store:
        manifest = store.manifest(args.name)
        with _progress(args, f"pull {manifest.key}", manifest.logical_bytes) as advance:
            store.pull(manifest.key, progress=advance)
        if args.to is not None:
            src = store.materialize(manifest.key, tensors=True)
            shutil.copytree(src, args.to, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".ember-manifest"))
            print(f"wrote {manifest.key} into {args.to}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    with _store(args) as store:
        report = store.gc(verify=args.verify)
    print(f"removed {report.removed_chunks} chunks ({_size(report.removed_bytes)}), "
          f"{report.removed_temp} temp files; {report.corrupt} corrupt")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    with _store(args) as store:
        stats = store.stats()
    table = Table("tier", "location", "chunks", "used", "capacity", "corrupt found")
    for t in stats.tiers:
        cap = "unlimited" if t.capacity is None else _size(t.capacity)
        table.add_row(t.name, t.location, str(t.chunks), _size(t.used), cap, str(t.corrupt_detected))
    console = Console()
    console.print(table)
    console.print(f"models: {stats.models}  logical: {_size(stats.logical_bytes)}  "
                  f"unique: {_size(stats.unique_bytes)}  dedupe ratio: {stats.dedupe_ratio:.2f}x")
    return 0


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
