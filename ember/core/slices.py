"""Accelerator slices: the unit of capacity an instance runs on.

On a CPU host the node's cores are one shared slice by default: any number of instances live on it within its
memory (each one its contract's `memory_mb`), and at most `max_running` of them work at once (a request in them,
or starting), so a burst does not thrash every core. A dedicated CPU slot (a contract's
`resources.dedicated_cores`), a MIG instance or a whole GPU is an exclusive slice: one awake instance at a time,
with its memory. The scheduler only sees kinds, memory and whether a slice is shared, so GPU slices plug in without
changing it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Slice:
    id: str                       # "cpu", "cpu-0", "gpu0-mig-1g.18gb-3"
    kind: str                     # "cpu", "mig-1g.18gb", "gpu-h200", ...
    memory_mb: int                # memory an instance on it may use (shared: all of its instances together)
    cpus: tuple[int, ...] = ()    # cores to pin the instance to (CPU slots)
    device: str | None = None     # e.g. a MIG or GPU UUID for CUDA_VISIBLE_DEVICES
    threads: int = 1              # intra-op threads the instance should use
    shared: bool = False          # many instances at once on it (the node's shared cores), else one awake instance
    max_running: int = 1          # shared: its instances that may work at once (a request in them, or starting)

    def fits(self, kind: str, memory_mb: int) -> bool:
        return self.kind == kind and memory_mb <= self.memory_mb


def cpu_slices(cores: int, memory_mb_each: int, slots_per_core: int = 1) -> list[Slice]:
    """Dedicated slots: one per core by default; more slots per core oversubscribe on purpose."""
    return [
        Slice(id=f"cpu-{c}-{s}" if slots_per_core > 1 else f"cpu-{c}", kind="cpu",
              memory_mb=memory_mb_each, cpus=(c,), threads=1)
        for c in range(cores)
        for s in range(slots_per_core)
    ]


def shared_cpu_slice(cpus: tuple[int, ...], memory_mb: int, max_running: int, threads: int = 1) -> Slice:
    """The node's shared cores: every instance not on a dedicated slot, within `memory_mb` together, at most
    `max_running` of them working at once, each with `threads` intra-op threads."""
    return Slice(id="cpu", kind="cpu", memory_mb=memory_mb, cpus=tuple(sorted(set(cpus))), threads=threads,
                 shared=True, max_running=max(1, max_running))


def node_cpu_slices(slots: list[Slice], dedicated: int) -> list[Slice]:
    """The node's CPU slices from its slots (each with its cores and memory): the last `dedicated` stay slots of
    their own (one instance each); the others make one shared slice, whose memory is theirs together and which
    runs as many instances at once as they are. No slots: none (a gateway only)."""
    shared, own = slots[:len(slots) - dedicated], slots[len(slots) - dedicated:]
    out = [replace(s, id=f"cpu-{i}") for i, s in enumerate(own)]
    if shared:
        cpus = tuple(c for s in shared for c in s.cpus)
        out.insert(0, shared_cpu_slice(cpus, sum(s.memory_mb for s in shared), len(shared), shared[0].threads))
    return out

