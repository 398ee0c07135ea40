"""A template: a per-model process that holds the loaded model and only forks replicas.

It never runs inference: a forward pass would start the torch/OpenMP thread pool, and a
process with threads cannot be forked safely. After loading it freezes the garbage
collector's view of every object, so that collections in the replicas do not write to
(and thereby un-share) the copy-on-write pages holding the model.
"""

from __future__ import annotations

import gc
import socket
from typing import NoReturn

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
    gc.freeze()

    def fork_replica(header: Header, child_listener: socket.socket) -> NoReturn:
        try:
            slice_ = slice_from_json(header.get("slice"))
        except BaseException as err:
            refuse(child_listener, err)
        run_instance(child_listener, contract, slice_, lambda: model)

    ForkServer(listener, fork_replica).serve_forever()
