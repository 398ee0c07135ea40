"""A template: a per-model process that holds the loaded model and only forks replicas.

It never runs inference: a forward pass would start the torch/OpenMP thread pool, and a
process with threads cannot be forked safely. After loading it

- maps the pages of memory-mapped weight files into itself (MADV_POPULATE_READ: no copy, no
  thread), so that replicas share those page-cache pages with it; otherwise each replica's
  first requests fault its own view of them and pay for it alone in PSS;
- freezes the garbage collector's view of every object, so that collections in the replicas
  do not write to (and thereby un-share) the copy-on-write pages holding the model.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import socket
from pathlib import Path
from typing import NoReturn

from ember.errors import EmberError
from ember.node import procinfo
from ember.node.forkserver import ForkServer, refuse
from ember.node.framing import Header
from ember.node.instance import run_instance, slice_from_json
from ember.runtimes import Runtime
from ember.wire.contract import ModelContract


def run_template(listener: socket.socket, runtime: Runtime, contract: ModelContract) -> NoReturn:
    """Load the model, then serve fork commands whose children become instances of it."""
    try:
        model = runtime.load(contract)
    except BaseException as err:
        refuse(listener, err)
    populate_weights(contract)
    gc.freeze()

    def fork_replica(header: Header, child_listener: socket.socket) -> NoReturn:
        try:
            slice_ = slice_from_json(header.get("slice"))
        except BaseException as err:
            refuse(child_listener, err)
        run_instance(child_listener, contract, slice_, lambda: model)

    ForkServer(listener, fork_replica).serve_forever()


_MADV_POPULATE_READ = 22   # Linux 5.14+


def populate_weights(contract: ModelContract) -> int:
    """Map the resident pages of the contract's mmapped weight files into this process; bytes covered."""
    try:
        root = contract.weights_path()
    except EmberError:
        return 0
    if root is None:
        return 0
    root = root.resolve()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    covered = 0
    for start, end, path in procinfo.file_mappings():
        mapped = Path(path)
        if mapped != root and root not in mapped.parents:
            continue
        if libc.madvise(start, end - start, _MADV_POPULATE_READ) == 0:
            covered += end - start
        else:  # an older kernel: replicas then fault their own views (correct, just less shared)
            logging.getLogger("ember.node").info("madvise(POPULATE_READ) on %s: errno %d", path, ctypes.get_errno())
    return covered
