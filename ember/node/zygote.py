"""A zygote: a per-runtime process with the runtime's heavy imports done, forking on command.

Started by the node as `python -m ember.node.zygote --runtime NAME --listen-fd FD --parent-pid PID`
on a listening socket the node bound. It imports the runtime (`preload()`: no thread pools),
freezes the garbage collector's view of those objects, greets the node and serves fork commands
(see `ember.node.forkserver`) for two kinds of child:

- kind "instance": load the contract's model in the child, warm up, serve (rung ZYGOTE or FETCH);
- kind "template": load the contract's model and become its template (rung TEMPLATE's parent).

A runtime that can (`hold`: the llm runtime) also maps a deployed model's weights here, on the node's `hold`
command, so that an instance forked after it starts with its weights mapped and its vocabulary read (the rung's
"weights mapped from the local store"); `drop` lets it go when the model is released.

A fork command may carry `store` (the node's weight store settings): the child then opens a store of
its own for a contract whose weights are `store:NAME[:VERSION]`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import socket
import time
from typing import NoReturn

from ember.node.child import die_with_parent, set_threads
from ember.node.forkserver import ForkServer, refuse
from ember.node.framing import Header
from ember.node.instance import contract_from_json, run_instance, sandbox_from_json, slice_from_json
from ember.node.loading import ModelLoader
from ember.node.procinfo import thread_count
from ember.node.sandbox import prepare as prepare_sandbox
from ember.node.template import run_template
from ember.node.weights import store_from_json
from ember.runtimes import HoldingRuntime, Runtime, get_runtime


def fork_child(runtime: Runtime, header: Header, listener: socket.socket) -> NoReturn:
    """In the forked child: become a template or an instance of the commanded contract."""
    try:
        contract = contract_from_json(header.get("contract"))
        store = store_from_json(header.get("store"))
        sandbox = sandbox_from_json(header.get("sandbox"))
        kind = header.get("kind")
        if kind not in ("instance", "template"):
            raise ValueError(f"fork: unknown kind {kind!r}")
        if isinstance(runtime, HoldingRuntime):
            runtime.keep(contract)   # before the sandbox: no other model's weights, an address space of its own
        if kind == "template":
            run_template(listener, runtime, contract, store, sandbox)
        slice_ = slice_from_json(header.get("slice"))
    except BaseException as err:
        refuse(listener, err)
    run_instance(listener, contract, slice_, ModelLoader(runtime, contract, store), sandbox=sandbox)


def raise_fd_limit() -> None:
    """Soft open-files limit up to the hard one: each tensor chunk mapped from the weight store keeps
    a descriptor (mmap duplicates it), and a model of a few thousand tensors passes the usual 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))


def main(argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(prog="python -m ember.node.zygote")
    parser.add_argument("--runtime", required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    raise_fd_limit()
    listener = socket.socket(fileno=args.listen_fd)
    set_threads(1)  # before any import can start a pool: children raise it to their slice's count
    try:
        runtime = get_runtime(args.runtime)
        runtime.preload()
    except BaseException as err:
        refuse(listener, err)
    prepare_sandbox()
    gc.freeze()
    ops = {"hold": lambda header: hold(runtime, header, True), "drop": lambda header: hold(runtime, header, False)}
    ForkServer(listener, lambda header, child_listener: fork_child(runtime, header, child_listener),
               hello={"holds": isinstance(runtime, HoldingRuntime)}, ops=ops).serve_forever()


def hold(runtime: Runtime, header: Header, keep: bool) -> Header:
    """Hold (`keep`) or drop the commanded contract's model in this process; what was done, and the threads after
    it (a hold must start none: this process forks)."""
    contract = contract_from_json(header.get("contract"))
    started = time.monotonic()
    held = False
    if isinstance(runtime, HoldingRuntime):
        if keep:
            held = runtime.hold(contract)
        else:
            runtime.drop(contract)
    gc.freeze()   # what it loaded joins the frozen objects: collections in the children leave its pages shared
    return {"op": "held", "held": held, "seconds": time.monotonic() - started, "threads": thread_count()}


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
