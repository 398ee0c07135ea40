"""What a freshly forked (or spawned) node process does to itself before it works.

Every node process dies with its parent (PR_SET_PDEATHSIG), so a crashed node or
template never leaves orphans behind. An instance also reseeds its random generators
(a fork copies the parent's state: replicas would otherwise draw the same numbers),
pins itself to its slice and sets its own thread count, which the zygote and the
template keep at one so that no thread pool exists when they fork.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import sys
from typing import NoReturn

from ember.core.slices import Slice
from ember.errors import InvalidInput

_PR_SET_PDEATHSIG = 1
# RAYON_NUM_THREADS sizes the tokenizers pool, which starts lazily on the first request.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")


def die_with_parent(expected_parent: int) -> None:
    """SIGKILL this process when its parent dies; exit at once if the parent is already gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died between fork and prctl: then we were re-parented already.
    if os.getppid() != expected_parent:
        os._exit(1)


def reseed() -> None:
    """Fresh seeds from the OS for random, numpy and (if imported) torch."""
    random.seed(os.urandom(32))
    # Only if already imported: numpy.random loads lazily (10 ms, 5 MB) and seeds itself from the OS.
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed(int.from_bytes(os.urandom(4), "little"))
    torch = sys.modules.get("torch")
    if torch is not None:
        # Not torch.manual_seed: its first call imports backends (about 5 ms in every child).
        seed = int.from_bytes(os.urandom(8), "little") >> 1
        torch.default_generator.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)  # lazy: applied if and when CUDA initialises


def pin(slice_: Slice) -> None:
    """Run on the slice's cores and device only."""
    if slice_.cpus:
        # Not checked against this process's own mask: the node's processes may keep off the slices' cores
        # (ember.server); the kernel refuses cores outside the cpuset (a container's), and that is said plainly.
        try:
            os.sched_setaffinity(0, slice_.cpus)
        except OSError as err:
            raise InvalidInput(f"slice {slice_.id}: cores {list(slice_.cpus)} are not all allowed here "
                               f"({err.strerror}; this process runs on {sorted(os.sched_getaffinity(0))})") from None
    if slice_.device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = slice_.device


def set_threads(threads: int) -> None:
    """The instance's intra-op thread count (the template and zygote run with one)."""
    for name in _THREAD_ENV:
        os.environ[name] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def become_instance(slice_: Slice) -> None:
    reseed()
    pin(slice_)
    set_threads(max(1, slice_.threads))


def hard_exit(code: int) -> NoReturn:
    """Leave without interpreter teardown (with torch loaded a normal exit takes seconds)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
