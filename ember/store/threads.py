"""Thread pools whose threads are all running before the pool is handed out, never started mid-load."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor


def started_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A ThreadPoolExecutor with all `threads` threads started (the store's pools; the origin's range-request pool
    starts its threads on demand, during fetches that take far longer).

    ThreadPoolExecutor starts its threads on its first submits, which in the store means in the middle of a
    load: starting a thread maps its stack (and its first malloc an arena), which waits for the mmap lock
    that page-ins in flight hold, and every page fault and mmap of the process then queues behind it. On a
    warm disk tier that stall was most of the time to the last view (docs/store.md); starting the threads
    up front costs about 0.2 ms each here, before any load.
    """
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
    ready = threading.Barrier(threads + 1)
    for _ in range(threads):  # each task holds its thread until all have started, so every submit starts one
        pool.submit(ready.wait, 10.0)
    with contextlib.suppress(threading.BrokenBarrierError):
        ready.wait(10.0)
    return pool
