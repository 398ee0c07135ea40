"""A snapshot host: a process that loads one model, is dumped to an image (CRIU), and serves once restored.

Started by the node (`ember.node.snapshots.make_image`) as the root of a pid namespace of its own, with its stdio
on /dev/null and one Unix socket to the node at `--fd`:

    python -m ember.node.snapshot_host --runtime NAME --contract FILE.json --fd 3

It loads the contract's model (its runtime's `load`, no store), runs the contract's warm-up requests (it never
forks, so thread pools may start: CRIU saves them with it), freezes the garbage collector's view and says
`{op: loaded}`. It then blocks reading its socket; the node dumps it there. A restore hands it a new socket in the
old one's place, and the read goes on on that one:

- `{op: hello}` -> the RNGs re-seeded from the OS (every copy of one image would otherwise draw the same numbers),
  `{op: hello, ok, pid, restored_at, monotonic}` (CRIU restores it in a time namespace of its own: its
  monotonic clock goes on from where the dump left it, on any host, never back);
- `{op: infer, tensors}` -> the model's reply, `{op: reply, tensors}` (or `{op: error, ...}`);
- `{op: become, sock, contract, slice, sandbox}` -> it binds its instance socket at `sock`, answers `{op: bound}`,
  leaves this connection and becomes an instance of the node's (`ember.node.instance.run_instance`: into its
  sandbox, its slice's cores and threads, then the node's hello on `sock`), as a zygote's child does after its load;
- `{op: become_template, sock, contract, sandbox}` -> the same, as the model's template
  (`ember.node.template.run_template`: into its sandbox, then it forks replicas). It loads and warms on one thread
  (as a template does) so that a copy can fork: `{op: loaded}` says how many threads it has (and its monotonic
  clock); only a copy of an image made with one becomes a template.
- end of the connection: exit.

An image holds no request the node served after it was made: it is made by a process of its own, before any request
but the contract's warm-up reaches it. It does hold what the model's load restores: an llm model's declared prefixes
and the learned prefixes its tenant's earlier instances kept (ember.node.keeping), as every load of it does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

from ember.errors import ModelNotReady
from ember.node.child import hard_exit, reseed, set_threads
from ember.node.forkserver import error_header, listen_unix
from ember.node.framing import Header, recv_frame, send_frame
from ember.node.instance import contract_from_json, run_instance, sandbox_from_json, slice_from_json, warm_up
from ember.node.loading import Loaded
from ember.node.procinfo import thread_count
from ember.node.template import run_template
from ember.node.weights import populate_weights
from ember.runtimes import LoadedModel, get_runtime, replies_of


def become(conn: socket.socket, header: Header, model: LoadedModel, template: bool) -> NoReturn:
    try:
        contract = contract_from_json(header.get("contract"))
        slice_ = None if template else slice_from_json(header.get("slice"))
        sandbox = sandbox_from_json(header.get("sandbox"))
        if template and thread_count() != 1:
            raise ModelNotReady(f"it has {thread_count()} threads: a template with threads cannot fork safely")
        listener = listen_unix(str(header.get("sock")))
    except BaseException as err:
        send_frame(conn, error_header(err, default="ModelNotReady"))
        hard_exit(1)
    send_frame(conn, {"op": "bound", "pid_in_namespace": os.getpid()})
    conn.close()
    # A restore maps the weight files again, without page tables: one madvise maps their cached pages now, where the
    # first request would fault them in page by page (thousands of traps for a GGUF of gigabytes).
    populate_weights(contract)
    if slice_ is None:
        run_template(listener, None, contract, sandbox=sandbox, restored=model)
    run_instance(listener, contract, slice_, Loaded(model, sandboxed=False), warmed=True, sandbox=sandbox)


def serve(conn: socket.socket, model: LoadedModel) -> None:
    while True:
        frame = recv_frame(conn)
        if frame is None:
            return
        if frame.op in ("become", "become_template"):
            become(conn, frame.header, model, template=frame.op == "become_template")
        if frame.op == "hello":
            reseed()
            send_frame(conn, {"op": "hello", "ok": True, "pid": os.getpid(), "restored_at": time.time(),
                              "monotonic": time.monotonic()})
            continue
        try:
            if frame.op != "infer":
                raise ValueError(f"snapshot host: unknown op {frame.op!r}")
            replies = [r for r in replies_of(model, frame.tensors()) if r is not None]
            send_frame(conn, {"op": "reply", "count": len(replies)}, replies[-1] if replies else {})
        except Exception as err:   # the request's failure is its reply
            send_frame(conn, error_header(err))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember.node.snapshot_host")
    parser.add_argument("--runtime", required=True)
    parser.add_argument("--contract", required=True, type=Path)
    parser.add_argument("--fd", required=True, type=int)
    args = parser.parse_args(argv)
    conn = socket.socket(fileno=args.fd)
    try:
        set_threads(1)   # as a zygote and a template: so that a copy of it can fork (an instance sets its own)
        runtime = get_runtime(args.runtime)
        runtime.preload()
        contract = contract_from_json(json.loads(args.contract.read_text()))
        model = runtime.load(contract)
        warm_up(model, contract)   # it never forks: its thread pools may start, and are in the image
        gc.collect()
        gc.freeze()
    except BaseException as err:
        send_frame(conn, {**error_header(err, default="ModelNotReady"), "op": "loaded", "ok": False})
        return 1
    send_frame(conn, {"op": "loaded", "ok": True, "threads": thread_count(), "monotonic": time.monotonic()})
    serve(conn, model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
