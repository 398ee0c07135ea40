"""Device check: ember's GPU load path against safetensors.torch.load_file(device="cuda"), in one call.

    python bench/gpu_load_check.py [--gib 2] [--reps 3]

Writes a synthetic checkpoint, pushes it into a store in a temp dir, then times, with the page cache warm:
safetensors.torch.load_file(path, device="cuda") and ember's TensorMap.to_device("cuda") (pinned staging
buffers, one CUDA stream per worker, prefetch threads paging chunks in meanwhile); checks every tensor is
bit-for-bit equal on the device. Prints a table, writes bench/results/gpu_load_check.json. Without CUDA it
says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.store import StoreConfig, WeightStore, open_tensors
from ember.testing.checkpoints import llm_specs, write_checkpoint


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_load_check.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_load_check: CUDA is not available here; skipping (no figures)")
        return 0
    from safetensors.torch import load_file

    work = Path(tempfile.mkdtemp(prefix="ember-gpu-"))
    shm = Path(tempfile.mkdtemp(prefix="ember-gpu-shm-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        path = write_checkpoint(work / "model" / "model.safetensors", llm_specs(int(args.gib * (1 << 30))))
        size = path.stat().st_size
        store = WeightStore(StoreConfig(root=work / "store", memory_dir=shm, memory_capacity=2 * size + (1 << 30)))
        store.push(path.parent, "gpu:1")
        store.pull("gpu:1")
        reference = load_file(path)
        device = torch.device("cuda")

        def peer() -> dict[str, torch.Tensor]:
            return load_file(path, device="cuda")

        def ember() -> dict[str, torch.Tensor]:
            return open_tensors("gpu:1", store=store).to_device(device, streams=args.streams)

        results = {}
        for label, fn in (("safetensors load_file cuda", peer), ("ember to_device cuda", ember)):
            fn()  # CUDA context, allocator and page cache warm
            times = []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            bad = [k for k, v in reference.items()
                   if not torch.equal(v.reshape(-1).view(torch.uint8), out[k].cpu().reshape(-1).view(torch.uint8))]
            median = statistics.median(times)
            results[label] = {"median_s": median, "all_s": times, "gbps": size / median / 1e9, "mismatches": bad}
            del out
            torch.cuda.empty_cache()
        ratio = results["safetensors load_file cuda"]["median_s"] / results["ember to_device cuda"]["median_s"]
        print(f"{torch.cuda.get_device_name()}: {size / (1 << 30):.2f} GiB, {len(reference)} tensors")
        for label, r in results.items():
            print(f"{label:30} {r['median_s']:8.3f} s {r['gbps']:7.2f} GB/s  mismatches: {len(r['mismatches'])}")
        print(f"ember / load_file speedup: {ratio:.2f}x (target >= 2x)")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "bytes": size, "results": results,
                                        "speedup": ratio}, indent=1))
        store.close()
        return 1 if any(r["mismatches"] for r in results.values()) else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
