"""Accelerator slices: the unit of capacity an instance runs on.

On a CPU host a slice is a CPU slot (one core by default); on a GPU host it is a MIG
instance (or a whole GPU) with its memory. The scheduler only sees kinds and memory,
so GPU slices plug in without changing it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slice:
    id: str                       # "cpu-0", "gpu0-mig-1g.18gb-3"
    kind: str                     # "cpu", "mig-1g.18gb", "gpu-h200", ...
    memory_mb: int                # memory an instance on it may use
    cpus: tuple[int, ...] = ()    # cores to pin the instance to (CPU slots)
    device: str | None = None     # e.g. a MIG or GPU UUID for CUDA_VISIBLE_DEVICES
    threads: int = 1              # intra-op threads the instance should use

    def fits(self, kind: str, memory_mb: int) -> bool:
        return self.kind == kind and memory_mb <= self.memory_mb


def cpu_slices(cores: int, memory_mb_each: int, slots_per_core: int = 1) -> list[Slice]:
    """One slot per core by default; more slots per core oversubscribe on purpose."""
    return [
        Slice(id=f"cpu-{c}-{s}" if slots_per_core > 1 else f"cpu-{c}", kind="cpu",
              memory_mb=memory_mb_each, cpus=(c,), threads=1)
        for c in range(cores)
        for s in range(slots_per_core)
    ]
