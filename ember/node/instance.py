"""An instance: a forked process that holds a loaded model and serves requests one at a time.

Startup, in the child: reseed, pin to the slice, set its thread count, load the model (from
the zygote) or use the template's copy-on-write one, run the contract's warmup requests, and
only then greet the node's connection with a hello. Then it serves frames in order:

- {op: infer, id, poll_s, tensors} -> {op: result, id, tensors} or {op: error, id, error, message};
                              then it polls for the next frame for up to poll_s (optional) before blocking
- {op: ping, id}           -> {op: pong, id}
- {op: drain, id}          -> {op: drained, id}, then the process leaves with os._exit(0);
                              frames sent before the drain were answered first.

A model exception becomes an error frame (ModelFailed, or the EmberError it raised, such as
InvalidInput); the instance lives on.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any, NoReturn

import numpy as np

from ember.core.slices import Slice
from ember.errors import InvalidInput
from ember.node.child import become_instance, hard_exit
from ember.node.forkserver import error_header, refuse
from ember.node.framing import Frame, Header, encode_frame, recv_frame, send_buffers, send_frame
from ember.node.polling import poll_readable
from ember.node.procinfo import thread_count
from ember.runtimes import LoadedModel
from ember.wire.contract import ModelContract
from ember.wire.tensors import validate_inputs, warmup_inputs


def slice_to_json(slice_: Slice) -> dict[str, Any]:
    return asdict(slice_)


def slice_from_json(data: object) -> Slice:
    if not isinstance(data, dict):
        raise InvalidInput("fork: 'slice' must be an object")
    try:
        return Slice(**{**data, "cpus": tuple(data.get("cpus", ()))})
    except TypeError as err:
        raise InvalidInput(f"fork: bad 'slice': {err}") from None


def contract_from_json(data: object) -> ModelContract:
    if not isinstance(data, dict):
        raise InvalidInput("fork: 'contract' must be an object")
    return ModelContract.model_validate(data)


def warm_up(model: LoadedModel, contract: ModelContract) -> None:
    """Run the contract's warmup requests (they start the thread pool and fill caches)."""
    inputs = warmup_inputs(contract)
    for _ in range(contract.warmup.requests):
        model.infer(inputs)


def run_instance(listener: socket.socket, contract: ModelContract, slice_: Slice,
                 load: Callable[[], LoadedModel]) -> NoReturn:
    """Become an instance: prepare, load, warm up, greet the node, serve until drained."""
    t0 = time.perf_counter()
    try:
        become_instance(slice_)
        model = load()
        t1 = time.perf_counter()
        warm_up(model, contract)
        t2 = time.perf_counter()
    except BaseException as err:
        refuse(listener, err)
    listener.setblocking(True)
    conn, _ = listener.accept()
    send_frame(conn, {"op": "hello", "ok": True, "threads": thread_count(),
                      "load_s": t1 - t0, "warmup_s": t2 - t1})
    InstanceServer(model, contract).serve(listener, conn)


def poll_after(header: Header) -> float:
    """How long the node asked this instance to poll after answering (`poll_s`; anything else: not at all)."""
    value = header.get("poll_s", 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return 0.0
    return float(value)


class InstanceServer:
    """Answers frames one at a time on one connection; a new connection replaces a closed one.

    After a reply it polls the connection for as long as the request's `poll_s` said before blocking
    (`ember.node.polling`): a client that sends its next request at once finds the instance awake.
    """

    def __init__(self, model: LoadedModel, contract: ModelContract) -> None:
        self.model = model
        self.contract = contract

    def serve(self, listener: socket.socket, conn: socket.socket) -> NoReturn:
        poll_s = 0.0
        while True:
            poll_readable(conn, poll_s)
            try:
                frame = recv_frame(conn)
            except (InvalidInput, OSError) as err:
                self._try_send(conn, error_header(err, default="InvalidInput"))
                frame = None
            if frame is None:
                conn.close()
                conn, _ = listener.accept()
                poll_s = 0.0
                continue
            header, tensors = self.handle(frame)
            sent = self._try_send(conn, header, tensors)
            poll_s = poll_after(frame.header)
            if frame.op == "drain":
                hard_exit(0 if sent else 1)

    def handle(self, frame: Frame) -> tuple[Header, Mapping[str, np.ndarray] | None]:
        request_id = frame.header.get("id")
        op = frame.op
        if op == "infer":
            try:
                inputs = frame.tensors()
                validate_inputs(self.contract, inputs)
                outputs = self.model.infer(inputs)
            except Exception as err:
                return error_header(err, request_id), None
            return {"op": "result", "id": request_id}, outputs
        if op == "ping":
            return {"op": "pong", "id": request_id}, None
        if op == "drain":
            return {"op": "drained", "id": request_id}, None
        return error_header(InvalidInput(f"instance: unknown op {op!r}"), request_id), None

    @staticmethod
    def _try_send(conn: socket.socket, header: Header, tensors: Mapping[str, np.ndarray] | None = None) -> bool:
        try:
            buffers = encode_frame(header, tensors)
        except Exception as err:  # outputs that cannot be encoded: the model's fault
            buffers = encode_frame(error_header(err, header.get("id")))
        try:
            send_buffers(conn, buffers)
            return True
        except OSError:
            return False
