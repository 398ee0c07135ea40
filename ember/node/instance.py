"""An instance: a forked process that holds a loaded model and serves many requests at once.

Startup, in the child: its sandbox entered, reseed, pin to the slice, set its thread count, close the sandbox
(`ember.node.sandbox`: its own user, read-only files, no network, seccomp) and load the model in it (from the
zygote; `ember.node.loading` says which loads precede the lock-down) or use the template's copy-on-write one (in
the template's sandbox), run the contract's warmup requests, and only then greet the node's connection with a
hello. Then it serves frames, multiplexed by id:

- {op: infer, id, poll_s, deadline, reply_bytes, tenant?, tensors}: queued, then answered by
    {op: result, id, tensors}                     one reply (a model that does not stream), or
    {op: result, id, more: true, tensors} ...     each reply of a streaming model, then {op: end, id};
    {op: error, id, kind, message, retry_after}   at any point instead (ends the request; ember.errors.error_fields)
  Queued requests of a batching contract run together (`ember.core.batching`); a streaming model's
  requests run interleaved, one reply from each in turn (iteration-level scheduling: a new stream starts
  between two replies of the others). A request past its `deadline` (CLOCK_MONOTONIC) is answered DeadlineExceeded.
  `tenant`: the caller's (absent: none), handed to a model that keeps state per tenant (`replies_of`).
- {op: cancel, id}         -> the request is dropped (queued) or stopped at the model's next check
                              (running): {op: cancelled, id}; nothing if it was already answered
- {op: ping, id}           -> {op: pong, id}, even while a batch runs
- {op: sleep, id, level}   -> an idle instance's model sleeps (`model.sleep(level)`: vLLM's sleep mode gives the
                              device memory back): {op: slept, id, held_mb}, the MB it still holds (what the model
                              says, else its resident memory); an error if it cannot or is not idle
- {op: wake, id}           -> `model.wake_up()` if it sleeps: {op: awake, id}; a request that arrives first wakes it
                              the same way
- {op: drain, id}          -> every earlier request is answered, the model's `retire()` runs if it has
                              one, then {op: drained, id, keep?, tensors?} and the process leaves with
                              os._exit(0); `keep`: what the model hands its node to write into the weight store
                              (`ember.node.keeping`: an LLM's learned prefixes), which it sees read-only

The node reads these frames under `payload_limits`: a reply's tensors at most `reply_bytes` (the least of the
instance's memory and the server's body budget), a drained frame's at most its memory, no other frame any; a reply
past its limit is answered ModelFailed instead (and a stream ended), and a process whose frame breaks the limits is
killed by its node.

A model exception becomes an error frame (ModelFailed, or the EmberError it raised, such as
InvalidInput); the instance lives on. A batch that fails is run again request by request, so one
bad request fails alone.
"""

from __future__ import annotations

import logging
import os
import re
import select
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import numpy as np

from ember.core.batching import BatchPolicy, DemandEstimate, Hold, Take, Waiting, next_batch
from ember.core.slices import Slice
from ember.errors import Cancelled, ContractInvalid, DeadlineExceeded, InvalidInput, ModelFailed, OutputMismatch
from ember.node.batch import concat, group_of, rows_of, split
from ember.node.child import become_instance, hard_exit
from ember.node.forkserver import error_header, refuse
from ember.node.framing import (
    MAX_PAYLOAD_BYTES,
    Frame,
    FrameReader,
    Header,
    PayloadLimits,
    encode_frame,
    payload_size,
    send_buffers,
    send_frame,
)
from ember.node.loading import Loader, load_sandboxed
from ember.node.polling import poll_readable
from ember.node.procinfo import thread_count
from ember.node.sandbox import Report, SandboxPlan
from ember.runtimes import LoadedModel, replies_of
from ember.wire.contract import ModelContract
from ember.wire.refs import NAME_PATTERN
from ember.wire.tensors import Tensors, check_outputs, validate_inputs, warmup_inputs


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


def batch_policy(contract: ModelContract) -> BatchPolicy:
    b = contract.batching
    return BatchPolicy(contract.max_batch_size, b.max_queue_delay_us / 1e6, b.preferred_batch_size)


def warm_up(model: LoadedModel, contract: ModelContract) -> None:
    """Run the contract's warmup requests (they start the thread pool and fill caches), checking the replies
    against the contract's outputs (ContractInvalid: the instance refuses to start, and says why)."""
    inputs = warmup_inputs(contract)
    try:
        for _ in range(contract.warmup.requests):
            for reply in replies_of(model, inputs):
                if reply is not None:   # None: no reply yet (a streaming model's step for nobody else)
                    check_outputs(contract, reply)
    except OutputMismatch as err:   # not a passing failure: the contract does not describe this model
        raise ContractInvalid(f"warm-up: {err.message}") from None


def sandbox_from_json(data: object) -> SandboxPlan | None:
    return SandboxPlan.from_json(data)


def run_instance(listener: socket.socket, contract: ModelContract, slice_: Slice, loader: Loader, *,
                 warmed: bool = False, sandbox: SandboxPlan | None = None,
                 inherited: dict[str, Any] | None = None) -> NoReturn:
    """Become an instance: load inside its sandbox (`ember.node.loading`: the model's code after the lock-down;
    `inherited`: a template's replica, in the template's sandbox already), warm up (unless the template that
    forked it did), greet the node, serve until drained."""
    t0 = time.perf_counter()
    report = Report()
    try:
        model = load_sandboxed(loader, None if inherited is not None else sandbox, report,
                               before_lock=lambda: become_instance(slice_))
        t1 = time.perf_counter()
        if not warmed:
            warm_up(model, contract)
        t2 = time.perf_counter()
    except BaseException as err:
        refuse(listener, err)
    listener.setblocking(True)
    conn, _ = listener.accept()
    hello: Header = {"op": "hello", "ok": True, "threads": thread_count(), "load_s": t1 - t0, "warmup_s": t2 - t1}
    if inherited is not None:
        hello["sandbox"] = {**inherited, "inherited": True}
    elif sandbox is not None:
        hello["sandbox"] = report.to_json()
    levels = model_sleep_levels(model)
    if levels:
        hello["sleep_levels"] = list(levels)
    send_frame(conn, hello)
    server = InstanceServer(model, contract)
    while True:
        server.serve(conn)
        conn.close()
        conn, _ = listener.accept()


def model_sleep_levels(model: LoadedModel) -> tuple[int, ...]:
    """The sleep levels a model offers (`sleep_levels`, with `sleep` and `wake_up`): of 1 and 2, () for none."""
    levels = getattr(model, "sleep_levels", ())
    if not (callable(getattr(model, "sleep", None)) and callable(getattr(model, "wake_up", None))):
        return ()
    try:
        return tuple(sorted({int(x) for x in levels} & {1, 2}))
    except (TypeError, ValueError):
        return ()


def sleep_levels(hello: Header) -> tuple[int, ...]:
    """The sleep levels an instance's hello offers (the node's reading of `model_sleep_levels`)."""
    levels = hello.get("sleep_levels")
    if not isinstance(levels, list):
        return ()
    return tuple(sorted({x for x in levels if type(x) is int and x in (1, 2)}))


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _number(header: Header, key: str, high: float) -> float:
    """A non-negative number field of a request header (anything else: 0)."""
    value = header.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
        return 0.0
    return float(value)


def _deadline(header: Header) -> float:
    """When the request stops being worth answering: `deadline`, in CLOCK_MONOTONIC seconds, which every
    process of the machine shares, so that time spent unread in the socket while a batch ran counts too."""
    value = header.get("deadline")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return float("inf")
    return float(value)


def payload_limits(contract: ModelContract, max_reply_bytes: int | None = None) -> PayloadLimits:
    """What an instance of `contract` may send with tensors: a reply (`result`) at most its memory
    (`resources.memory_mb`: it cannot have made more) and `max_reply_bytes` (the server's body budget; None: none),
    a drained frame's learned prefixes (`ember.node.keeping`) at most its memory; nothing else carries any."""
    memory = contract.resources.memory_mb << 20
    reply = memory if max_reply_bytes is None else min(memory, max_reply_bytes)
    return PayloadLimits({"result": reply, "drained": memory})


def reply_limit(header: Header) -> int:
    """The most tensor bytes one reply to this request may carry (`reply_bytes`; anything else: the frame's own)."""
    value = header.get("reply_bytes")
    return value if type(value) is int and 0 < value < MAX_PAYLOAD_BYTES else MAX_PAYLOAD_BYTES


def request_tenant(header: Header) -> str | None:
    """The tenant the node says a request is for (`tenant`; absent: none); InvalidInput unless a tenant name."""
    value = header.get("tenant")
    if value is not None and not (isinstance(value, str) and re.fullmatch(NAME_PATTERN, value)):
        raise InvalidInput(f"infer: 'tenant': {str(value)[:100]!r} is not a tenant name")
    return value


def poll_after(header: Header) -> float:
    """How long the node asked this instance to poll after answering (`poll_s`; anything else: not at all)."""
    return _number(header, "poll_s", 1.0)


@dataclass
class _Request:
    id: Any
    inputs: Tensors
    waiting: Waiting
    deadline: float          # time.monotonic(); inf without a timeout
    poll_s: float
    reply_bytes: int = MAX_PAYLOAD_BYTES   # the most tensor bytes one reply may carry
    tenant: str | None = None              # the caller's (a model keeping state per tenant is told)


class InstanceServer:
    """Serves one connection at a time (a new connection replaces a closed one), single-threaded.

    Between batches, and whenever the model checks `stop` inside one, it reads what has arrived: new
    requests join the queue, cancels take effect, pings are answered. After answering everything it polls
    the connection for as long as the last request's `poll_s` said before blocking (`ember.node.polling`).
    """

    def __init__(self, model: LoadedModel, contract: ModelContract,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.contract = contract
        self.policy = batch_policy(contract)
        self.demand = DemandEstimate()
        self._clock = clock
        self._queue: dict[Any, _Request] = {}
        self._running: set[Any] = set()
        self._cancelled: set[Any] = set()
        self._draining: Any = None
        self._poll_s = 0.0
        self._serial = 0
        self._streams: dict[Any, tuple[_Request, Iterator[Mapping[str, np.ndarray] | None]]] = {}
        self._streaming = bool(getattr(model, "streams", False))
        self._asleep = False

    def serve(self, conn: socket.socket) -> None:
        """Serve `conn` until it closes (queued work is dropped: nobody could read its answers)."""
        self._conn, self._reader = conn, FrameReader(conn)
        self._queue.clear()
        self._close_streams()
        while True:
            if not self._queue and not self._streams:
                self._wait_readable(None)
            if not self._pump():
                self._close_streams()
                return
            if self._streaming:
                self._step_streams()
                self._drained_yet()
                continue
            decision = self._decide()
            if isinstance(decision, Hold):
                self._wait_readable(max(0.0, decision.until - self._clock()))
            elif isinstance(decision, Take):
                self._run([self._queue.pop(rid) for rid in decision.ids])
                self._pump()
                self.demand.observe(decision.rows, sum(r.waiting.rows for r in self._queue.values()))
            self._drained_yet()

    def _drained_yet(self) -> None:
        if not self._queue and not self._streams and self._draining is not None:
            sent = self._send_buffers(self._drained_frame({"op": "drained", "id": self._draining}))
            hard_exit(0 if sent else 1)

    def _drained_frame(self, header: Header) -> list[bytes]:
        """The drained frame, with what the model hands its node to keep (an LLM's hottest prefixes) where it has
        any within the frame's limit (what it keeps is an optimisation: the drain goes on without)."""
        retire = getattr(self.model, "retire", None)
        if callable(retire):
            try:
                kept = retire()
                if kept is not None:
                    keep, tensors = kept.frame()
                    buffers = encode_frame({**header, "keep": keep}, tensors)
                    limit = payload_limits(self.contract).of(header)
                    if payload_size(buffers) <= limit:
                        return buffers
                    raise InvalidInput(f"what it keeps is {payload_size(buffers)} bytes, past its memory "
                                       f"({limit} bytes, resources.memory_mb)")
            except Exception as err:
                logging.getLogger("ember.node").warning("instance of %s: retire: %s", self.contract.key, err)
        return encode_frame(header)

    # --- streams: iteration-level scheduling ------------------------------------------------

    def _step_streams(self) -> None:
        """Admit every queued request as a stream, then take one reply from each: a new request starts
        between two replies of the others instead of waiting for them to finish."""
        self._expire_queued(self._clock())
        for rid in list(self._queue):
            req = self._queue.pop(rid)
            lend = self._stream_stop(req)
            self._streams[rid] = (req, iter(replies_of(self.model, req.inputs, lend, req.tenant)))
        for rid, (req, replies) in list(self._streams.items()):
            if rid in self._cancelled or req.deadline <= self._clock():
                self._end_stream(rid, stopped=True)
                continue
            try:
                reply = next(replies)
            except StopIteration:
                self._end_stream(rid)
                self._send({"op": "end", "id": rid})
            except Cancelled:
                self._end_stream(rid, stopped=True)
            except Exception as err:
                self._end_stream(rid)
                self._send(error_header(err, rid))
            else:
                # None: the model worked for the others this round, nothing of this one's
                if reply is not None and not self._reply(req, reply, more=True):
                    self._end_stream(rid)
            self._pump()

    def _stream_stop(self, req: _Request) -> Callable[[], bool]:
        def stop() -> bool:
            self._pump()
            return req.id in self._cancelled or req.deadline <= self._clock() or self._reader.eof
        return stop

    def _end_stream(self, rid: Any, *, stopped: bool = False) -> None:
        req, replies = self._streams.pop(rid)
        close = getattr(replies, "close", None)
        if callable(close):
            close()   # runs the model's `finally`
        if stopped:
            self._finish_stopped(req)
        self._cancelled.discard(rid)

    def _close_streams(self) -> None:
        for rid in list(self._streams):
            _req, replies = self._streams.pop(rid)
            close = getattr(replies, "close", None)
            if callable(close):
                close()
        self._cancelled.clear()

    # --- reading ----------------------------------------------------------------------------

    def _wait_readable(self, timeout_s: float | None) -> None:
        if timeout_s is None and poll_readable(self._conn, self._poll_s):
            return
        select.select([self._conn], [], [], timeout_s)

    def _pump(self) -> bool:
        """Take in what has arrived; False once the connection is gone."""
        try:
            frames = self._reader.pump()
        except (InvalidInput, OSError) as err:
            self._send(error_header(err, default="InvalidInput"))
            return False
        for frame in frames:
            self._accept(frame)
        return not self._reader.eof

    def _accept(self, frame: Frame) -> None:
        rid, op = frame.header.get("id"), frame.op
        if op == "infer":
            self._enqueue(frame)
        elif op == "cancel":
            self._cancel(rid)
        elif op == "ping":
            self._send({"op": "pong", "id": rid})
        elif op == "drain":
            self._draining = rid
        elif op in ("sleep", "wake"):
            self._rest(frame.header, rid)
        else:
            self._send(error_header(InvalidInput(f"instance: unknown op {op!r}"), rid))

    def _rest(self, header: Header, rid: Any) -> None:
        """Sleep the model (between requests only) or wake it (a no-op unless it sleeps)."""
        try:
            if header.get("op") == "wake":
                self._wake_model()
                self._send({"op": "awake", "id": rid})
                return
            if self._queue or self._running or self._streams or self._draining is not None:
                raise InvalidInput("instance: sleep while requests are in flight")
            level = header.get("level")
            if type(level) is not int or level not in model_sleep_levels(self.model):
                raise InvalidInput(f"instance: level: the model cannot sleep at {level!r}")
            self._asleep = True   # before: a sleep that fails partway is woken all the same
            held = self.model.sleep(level)  # type: ignore[attr-defined]
            held_mb = float(held) if isinstance(held, int | float) else _resident_mb()
            self._send({"op": "slept", "id": rid, "held_mb": held_mb})
        except Exception as err:
            self._send(error_header(err, rid))

    def _wake_model(self) -> None:
        if self._asleep:
            self.model.wake_up()  # type: ignore[attr-defined]
            self._asleep = False

    def _enqueue(self, frame: Frame) -> None:
        rid, now = frame.header.get("id"), self._clock()
        try:
            self._wake_model()   # a request that reached it before its wake frame wakes it

            inputs = frame.tensors()
            validate_inputs(self.contract, inputs)
            tenant = request_tenant(frame.header)
        except Exception as err:
            self._send(error_header(err, rid))
            return
        rows = rows_of(inputs)
        self._serial += 1
        # A request without a batch axis gets a group of its own: it never concatenates.
        group = group_of(inputs) if rows is not None else ("alone", self._serial)
        self._poll_s = poll_after(frame.header)
        self._queue[rid] = _Request(rid, inputs, Waiting(self._serial, rows or 1, now, group),
                                    _deadline(frame.header), self._poll_s, reply_limit(frame.header), tenant)

    def _cancel(self, rid: Any) -> None:
        if self._queue.pop(rid, None) is not None:
            self._send({"op": "cancelled", "id": rid})
        elif rid in self._running or rid in self._streams:
            self._cancelled.add(rid)

    # --- running ----------------------------------------------------------------------------

    def _expire_queued(self, now: float) -> None:
        for req in [r for r in self._queue.values() if r.deadline <= now]:
            del self._queue[req.id]
            self._send(error_header(DeadlineExceeded("the request's deadline passed while it was queued"), req.id))

    def _decide(self) -> Take | Hold | None:
        now = self._clock()
        self._expire_queued(now)
        by_serial = {r.waiting.id: r.id for r in self._queue.values()}
        decision = next_batch([r.waiting for r in self._queue.values()], now, self.policy,
                              self.demand.target(self.policy.max_batch_size))
        if isinstance(decision, Take):
            return Take(tuple(by_serial[s] for s in decision.ids), decision.rows)
        return decision

    def _stop_check(self, batch: list[_Request]) -> Callable[[], bool]:
        def stop() -> bool:
            """Read cancels (and new requests) that arrived; stop once nobody in the batch wants the answer."""
            if not self._pump():
                return True   # the node is gone: nobody can read the answers
            now = self._clock()
            return all(r.id in self._cancelled or r.deadline <= now for r in batch)
        return stop

    def _run(self, batch: list[_Request]) -> None:
        self._running = {r.id for r in batch}
        try:
            if len(batch) == 1 or not self._run_together(batch):
                for req in batch:
                    self._run_one(req)
        finally:
            self._running.clear()
            self._cancelled.clear()

    def _run_together(self, batch: list[_Request]) -> bool:
        """One forward pass for the whole batch; False when it must run request by request instead."""
        try:
            outputs = self.model.infer(concat([r.inputs for r in batch]), stop=self._stop_check(batch))
        except Cancelled:
            for req in batch:
                self._finish_stopped(req)
            return True
        except Exception:
            return False   # one request's bad input must not fail the others: run them alone
        parts = split(outputs, [r.waiting.rows for r in batch])
        if parts is None:
            return False
        for req, part in zip(batch, parts, strict=True):
            self._reply(req, part)
        return True

    def _run_one(self, req: _Request) -> None:
        if req.id in self._cancelled or req.deadline <= self._clock():
            self._finish_stopped(req)
            return
        try:
            self._reply(req, self.model.infer(req.inputs, stop=self._stop_check([req])))
        except Cancelled:
            self._finish_stopped(req)
        except Exception as err:
            self._send(error_header(err, req.id))

    def _finish_stopped(self, req: _Request) -> None:
        if req.id in self._cancelled:
            self._send({"op": "cancelled", "id": req.id})
        else:
            self._send(error_header(DeadlineExceeded("the request's deadline passed while it ran"), req.id))

    def _reply(self, req: _Request, outputs: Mapping[str, np.ndarray], *, more: bool = False) -> bool:
        """Send one reply to `req`; False when it was past the request's `reply_bytes` (answered ModelFailed)."""
        header: Header = {"op": "result", "id": req.id, **({"more": True} if more else {})}
        try:
            buffers = encode_frame(header, outputs)
        except Exception as err:  # outputs that cannot be encoded: the model's fault
            self._send(error_header(err, req.id))
            return False
        size = payload_size(buffers)
        if size > req.reply_bytes:
            self._send(error_header(ModelFailed(
                f"model '{self.contract.key}': a reply of {size} bytes, past the limit of {req.reply_bytes} "
                "(resources.memory_mb, and the server's max_inflight_mb)"), req.id))
            return False
        self._send_buffers(buffers)
        return True

    def _send(self, header: Header, tensors: Mapping[str, np.ndarray] | None = None) -> bool:
        try:
            buffers = encode_frame(header, tensors)
        except Exception as err:  # outputs that cannot be encoded: the model's fault
            buffers = encode_frame(error_header(err, header.get("id")))
        return self._send_buffers(buffers)

    def _send_buffers(self, buffers: list[bytes]) -> bool:
        try:
            send_buffers(self._conn, buffers)
            return True
        except OSError:
            return False
