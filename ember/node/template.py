"""A template: a per-model process that holds the loaded model and only forks replicas.

It loads inside its model's sandbox (`ember.node.loading`: its user, read-only view, no network, seccomp, its
own cgroups), and its replicas start in that sandbox: the node binds no socket in it, so the template binds its
replicas' sockets in the one directory the sandbox lets it write (the plan's `writable`).

It runs no inference, with one exception: a forward pass would start the torch/OpenMP thread pool,
and a process with threads cannot be forked safely, but a model that computes on one thread without
one (`warms_in_template`: the llm runtime) runs its warmup requests here, checked, so that replicas
start warm. After loading it

- maps the pages of memory-mapped weight files into itself (MADV_POPULATE_READ: no copy, no
  thread), so that replicas share those page-cache pages with it; otherwise each replica's
  first requests fault its own view of them and pay for it alone in PSS;
- freezes the garbage collector's view of every object, so that collections in the replicas
  do not write to (and thereby un-share) the copy-on-write pages holding the model.
"""

from __future__ import annotations

import gc
import socket
from typing import NoReturn

from ember.errors import ModelNotReady
from ember.node import procinfo
from ember.node.forkserver import ForkServer, refuse
from ember.node.framing import Header
from ember.node.instance import run_instance, sandbox_from_json, slice_from_json, warm_up
from ember.node.loading import Loaded, ModelLoader, load_sandboxed
from ember.node.sandbox import Report, SandboxPlan
from ember.node.sandbox import prepare as prepare_sandbox
from ember.node.weights import populate_weights
from ember.runtimes import LoadedModel, Runtime
from ember.store.config import StoreConfig
from ember.wire.contract import ModelContract


def run_template(listener: socket.socket, runtime: Runtime | None, contract: ModelContract,
                 store: StoreConfig | None = None, sandbox: SandboxPlan | None = None,
                 restored: LoadedModel | None = None) -> NoReturn:
    """Load the model inside the model's sandbox (store-backed weights through `store`; `ember.node.loading`),
    then serve fork commands whose children become instances of it, in the same sandbox. `restored`: the model
    is loaded and warmed already (a process restored from its image, `ember.node.snapshot_host`): the template
    only enters its sandbox."""
    report = Report()
    try:
        if restored is not None:
            model = load_sandboxed(Loaded(restored, sandboxed=False), sandbox, report)
            warmed = bool(getattr(model, "warms_in_template", False)) and contract.warmup.requests > 0
        else:
            assert runtime is not None
            model = load_sandboxed(ModelLoader(runtime, contract, store, template=True), sandbox, report)
            warmed = warm_in_template(model, contract)
    except BaseException as err:
        refuse(listener, err)
    prepare_sandbox()
    gc.freeze()
    inherited = None if sandbox is None else report.to_json()

    def fork_replica(header: Header, child_listener: socket.socket) -> NoReturn:
        try:
            slice_ = slice_from_json(header.get("slice"))
            # A fork copies no page-table entries of file mappings: the replica would fault the weights in page by
            # page on its first request (thousands of faults, each a trap on these VMs); one madvise maps them.
            populate_weights(contract, store)
        except BaseException as err:
            refuse(child_listener, err)
        run_instance(child_listener, contract, slice_, Loaded(model), warmed=warmed,
                     sandbox=sandbox_from_json(header.get("sandbox")), inherited=inherited)

    ForkServer(listener, fork_replica, hello={} if inherited is None else {"sandbox": inherited}).serve_forever()


def warm_in_template(model: LoadedModel, contract: ModelContract) -> bool:
    """Run the warmup requests here, once, if the model says that it can without starting threads
    (`warms_in_template`: an LLM on one thread). Replicas then start warm, with the template's caches (an LLM's
    prefix cache holds the warmup prompts), and skip their own warm-up: it was the larger part of a template
    fork's time to first token. A warm-up that fails, or that started a thread after all (forking would then
    risk the deadlock this process exists to avoid), fails the template with the reason."""
    if not getattr(model, "warms_in_template", False) or contract.warmup.requests == 0:
        return False
    before = procinfo.thread_count()
    warm_up(model, contract)
    started = procinfo.thread_count() - before
    if started > 0:
        raise ModelNotReady(f"model '{contract.key}': the template's warm-up started {started} thread(s); "
                            "it cannot fork safely")
    return True
