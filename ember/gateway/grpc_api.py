"""The KServe V2 gRPC binding, `inference.GRPCInferenceService` (Triton's and KServe's, on its own port: 8001),
through the same gate as HTTP: every RPC runs as a request of the gateway's own app, wrapped by the same guard
(`ember.gateway.app.guard`). It is admitted as an HTTP request is (the API key from the `authorization` metadata,
the key's role, its tenant's view of the models, the tenant's rate limit), measured (the request metrics, labelled
`api="grpc"`, the access log, a trace span continuing a `traceparent` metadata) and refused: an error of ember's one
tree becomes a gRPC status by `GRPC_CODE_OF`, with the HTTP error's message (and `retry-after` trailing metadata
where HTTP has Retry-After).

What each RPC runs:

- ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig, RepositoryIndex,
  RepositoryModelLoad, RepositoryModelUnload: the HTTP route's own handler, its JSON answer read into the message
  (a server or model not ready, or no such model, is `ready: false`, as Triton answers);
- ModelInfer: V2 infer's steps, decode (`ember.gateway.grpc_codec`), `validate_inputs`, the prompt check and
  `Service.infer`, its outputs in `raw_output_contents` (a text generation's replies joined in one row, as V2
  infer answers);
- ModelStreamInfer: each request on the stream as ModelInfer, opened with `Service.stream`: a response per reply
  (an LLM's text as it comes), the stream's requests answered concurrently
  (at most the port's concurrent calls at once; the next message waits unread till one ends), an error in-band
  (`error_message`).

Other RPCs of the service (statistics, shared memory, trace and log settings) answer UNIMPLEMENTED. A request's
message counts against the gateway's in-flight body budget (`max_inflight_mb`) as an HTTP body does, and one over
`max_body_mb` is refused. gRPC has no 202: a request that finds no room within `overload_wait_s` is UNAVAILABLE
with `retry-after`, as /v1 answers 429. The rung and instance that served a request come as initial metadata
(`ember-rung`, `ember-instance`) and as the response's parameters `ember_rung` and `ember_instance` (on a stream,
in a request's first reply).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ember.core.access import Access
from ember.errors import (
    Cancelled,
    ChunkNotFound,
    DeadlineExceeded,
    EmberError,
    Forbidden,
    InvalidInput,
    JobNotFound,
    JobStoreError,
    ModelFailed,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    StoreError,
    Unauthenticated,
    UnsupportedMediaType,
    WorkerCrashed,
)
from ember.gateway import v2
from ember.gateway.app import guard
from ember.gateway.chat_shape import generates_text, one_row
from ember.gateway.context import Gateway, gateway_of, label_model, off_loop
from ember.gateway.errors import internal_error, retry_after_header, status_of
from ember.gateway.grpc_codec import (
    GrpcInfer,
    decode_infer,
    encode_infer,
    encode_stream_end,
    encode_stream_error,
    encode_stream_reply,
    parse_message,
)
from ember.gateway.prompt_check import check_prompts
from ember.gateway.sse import GenerationMeter, _Timing
from ember.serving.results import InferResult, InferStream, client_message
from ember.wire.contract import ModelContract
from ember.wire.grpc import grpc_service_pb2 as pb
from ember.wire.tensors import validate_inputs

SERVICE = "inference.GRPCInferenceService"
MESSAGE = "ember.grpc.message"   # the scope key under which an RPC's request message reaches its handler
PASSED_METADATA = ("authorization", "traceparent", "tracestate", "user-agent")   # read as the HTTP headers
SERVED_BY = ("ember-rung", "ember-instance")
Code = grpc.StatusCode

# Looked up along the error's MRO (as ember.gateway.errors.STATUS_OF is), so subclasses inherit.
GRPC_CODE_OF: dict[type[EmberError], grpc.StatusCode] = {
    InvalidInput: Code.INVALID_ARGUMENT,
    UnsupportedMediaType: Code.INVALID_ARGUMENT,
    Unauthenticated: Code.UNAUTHENTICATED,
    Forbidden: Code.PERMISSION_DENIED,
    ModelNotFound: Code.NOT_FOUND,
    JobNotFound: Code.NOT_FOUND,
    ChunkNotFound: Code.NOT_FOUND,
    PayloadTooLarge: Code.RESOURCE_EXHAUSTED,
    RateLimited: Code.RESOURCE_EXHAUSTED,
    Overloaded: Code.UNAVAILABLE,
    ModelNotReady: Code.UNAVAILABLE,
    JobStoreError: Code.UNAVAILABLE,
    StoreError: Code.UNAVAILABLE,
    WorkerCrashed: Code.UNAVAILABLE,
    RequestTimeout: Code.DEADLINE_EXCEEDED,
    DeadlineExceeded: Code.DEADLINE_EXCEEDED,
    Cancelled: Code.CANCELLED,
    ModelFailed: Code.INTERNAL,
}

log = logging.getLogger("ember.gateway")

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"   # grpc has no type stubs: Any to mypy


def grpc_code(err: EmberError) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        if cls in GRPC_CODE_OF:
            return GRPC_CODE_OF[cls]
    return Code.INTERNAL


class _Refusal(Response):
    """An RPC's error as the guard renders it: the HTTP status (for the metrics and the access log), and the gRPC
    status, message and trailing metadata it is answered with."""

    def __init__(self, err: EmberError) -> None:
        retry = retry_after_header(err.retry_after) if isinstance(err, Overloaded | JobStoreError) else {}
        super().__init__(status_code=status_of(err), headers=retry)
        self.err, self.code, self.details = err, grpc_code(err), client_message(err)
        self.trailing = tuple((k.lower(), v) for k, v in retry.items())


@dataclass(frozen=True)
class _Rpc:
    name: str
    method: str   # what the guard sees: GET for a query, POST for what carries a message
    endpoint: Callable[[Request], Awaitable[Response]]
    access: Access = Access.USER

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"


class GrpcApi:
    """The service's RPCs over one gateway app (`handler()` for a grpc.aio server)."""

    def __init__(self, app: Starlette, stream_requests: int = 1) -> None:
        self.app = app
        self.stream_requests = stream_requests   # the most requests of one stream answered at once (more wait)
        self.gateway: Gateway = app.state.gateway
        public, admin = Access.PUBLIC, Access.ADMIN
        self.rpcs = {rpc.name: rpc for rpc in (
            self._rpc("ServerLive", v2.live, public), self._rpc("ServerReady", v2.ready, public),
            self._rpc("ServerMetadata", v2.server_metadata, public), self._rpc("ModelReady", v2.model_ready),
            self._rpc("ModelMetadata", v2.model_metadata), self._rpc("ModelConfig", v2.model_config),
            self._rpc("RepositoryIndex", v2.repository_index, method="POST"),
            self._rpc("RepositoryModelLoad", v2.load, admin, "POST"),
            self._rpc("RepositoryModelUnload", v2.unload, admin, "POST"),
            self._rpc("ModelInfer", self._infer, method="POST"),
            self._rpc("ModelStreamInfer", self._open_stream, method="POST"))}

    @staticmethod
    def _rpc(name: str, handler: Callable[[Request], Awaitable[Response]], access: Access = Access.USER,
             method: str = "GET") -> _Rpc:
        return _Rpc(name, method, guard(f"/{SERVICE}/{name}", "grpc", handler, _Refusal, access), access)

    def keyed(self, path: str) -> bool:
        """Whether the RPC at `path` needs an API key (with keys on): all but the public ones (and unknown paths)."""
        rpc = self.rpcs.get(path.rpartition("/")[2])
        return rpc is None or rpc.access is not Access.PUBLIC

    def handler(self) -> grpc.GenericRpcHandler:
        """Every RPC ember serves, its messages as bytes (each is parsed here, and answered serialized)."""
        unary = {"ServerLive": self.server_live, "ServerReady": self.server_ready,
                 "ServerMetadata": self.server_metadata, "ModelReady": self.model_ready,
                 "ModelMetadata": self.model_metadata, "ModelConfig": self.model_config,
                 "RepositoryIndex": self.repository_index, "RepositoryModelLoad": self.repository_model_load,
                 "RepositoryModelUnload": self.repository_model_unload, "ModelInfer": self.model_infer}
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            name: grpc.unary_unary_rpc_method_handler(_unexpected(name, fn)) for name, fn in unary.items()}
        methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(self.model_stream_infer)
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    # --- running an RPC through the guard ---------------------------------------------------------------------

    async def _run(self, name: str, context: Context, params: dict[str, str] | None = None, body: bytes = b"",
                   message: bytes | None = None) -> Response:
        rpc = self.rpcs[name]
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in context.invocation_metadata() or ()
                   if k in PASSED_METADATA and isinstance(v, str)]
        if body:
            headers.append((b"content-length", str(len(body)).encode()))
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "2",
                 "scheme": "http", "method": rpc.method, "path": rpc.path, "raw_path": rpc.path.encode(),
                 "root_path": "", "query_string": b"", "headers": headers, "client": _peer(context.peer()),
                 "server": None, "app": self.app, "state": {}, "path_params": params or {}, MESSAGE: message}
        return await rpc.endpoint(Request(scope, _receiver(body)))

    async def _answer(self, name: str, context: Context, params: dict[str, str] | None = None,
                      body: bytes = b"", message: bytes | None = None) -> Response:
        """The RPC's answer; a refusal is answered as the gRPC status here (context.abort raises)."""
        response = await self._run(name, context, params, body, message)
        if isinstance(response, _Refusal):
            await _abort(context, response)
        return response

    async def _json(self, name: str, context: Context, reply: Message, params: dict[str, str] | None = None,
                    body: bytes = b"", field: str | None = None) -> bytes:
        """The HTTP handler's JSON answer read into `reply` (under `field` of it, when given)."""
        data = json.loads(bytes((await self._answer(name, context, params, body)).body))
        json_format.ParseDict({field: data} if field else data, reply, ignore_unknown_fields=True)
        return reply.SerializeToString()

    async def _readiness(self, name: str, context: Context, reply: pb.ServerReadyResponse | pb.ModelReadyResponse,
                         params: dict[str, str] | None = None) -> bytes:
        response = await self._run(name, context, params)
        if isinstance(response, _Refusal) and not isinstance(response.err, ModelNotReady | ModelNotFound):
            await _abort(context, response)
        reply.ready = not isinstance(response, _Refusal)
        return reply.SerializeToString()

    # --- the RPCs ------------------------------------------------------------------------------------------------

    async def server_live(self, raw: bytes, context: Context) -> bytes:
        return await self._json("ServerLive", context, pb.ServerLiveResponse())

    async def server_ready(self, raw: bytes, context: Context) -> bytes:
        return await self._readiness("ServerReady", context, pb.ServerReadyResponse())

    async def server_metadata(self, raw: bytes, context: Context) -> bytes:
        return await self._json("ServerMetadata", context, pb.ServerMetadataResponse())

    async def model_ready(self, raw: bytes, context: Context) -> bytes:
        query = pb.ModelReadyRequest.FromString(raw)
        return await self._readiness("ModelReady", context, pb.ModelReadyResponse(), _model(query.name, query.version))

    async def model_metadata(self, raw: bytes, context: Context) -> bytes:
        query = pb.ModelMetadataRequest.FromString(raw)
        return await self._json("ModelMetadata", context, pb.ModelMetadataResponse(),
                                _model(query.name, query.version))

    async def model_config(self, raw: bytes, context: Context) -> bytes:
        query = pb.ModelConfigRequest.FromString(raw)
        return await self._json("ModelConfig", context, pb.ModelConfigResponse(), _model(query.name, query.version),
                                field="config")

    async def repository_index(self, raw: bytes, context: Context) -> bytes:
        query = pb.RepositoryIndexRequest.FromString(raw)
        return await self._json("RepositoryIndex", context, pb.RepositoryIndexResponse(),
                                body=json.dumps({"ready": query.ready}).encode(), field="models")

    async def repository_model_load(self, raw: bytes, context: Context) -> bytes:
        query = pb.RepositoryModelLoadRequest.FromString(raw)
        body = json.dumps({"parameters": {k: _parameter(p) for k, p in query.parameters.items()}}).encode()
        return await self._json("RepositoryModelLoad", context, pb.RepositoryModelLoadResponse(),
                                {"model": query.model_name}, body)

    async def repository_model_unload(self, raw: bytes, context: Context) -> bytes:
        query = pb.RepositoryModelUnloadRequest.FromString(raw)
        body = json.dumps({"parameters": {k: _parameter(p) for k, p in query.parameters.items()}}).encode()
        return await self._json("RepositoryModelUnload", context, pb.RepositoryModelUnloadResponse(),
                                {"model": query.model_name}, body)

    async def model_infer(self, raw: bytes, context: Context) -> bytes:
        response = await self._answer("ModelInfer", context, message=raw)
        # Trailing: sent with the status, at no cost of its own (initial metadata sent apart is one more write).
        context.set_trailing_metadata(tuple((k, response.headers[k]) for k in SERVED_BY if k in response.headers))
        return bytes(response.body)

    async def model_stream_infer(self, requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
        """Each request on the stream answered as it comes, concurrently; the stream ends once the client has
        closed its side and every request has been answered."""
        await self._check_key(context)
        out: asyncio.Queue[bytes | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()
        room = asyncio.Semaphore(self.stream_requests)

        async def read() -> None:
            try:
                async for raw in requests:
                    await room.acquire()   # no room: the next message waits unread (the client's flow control)
                    task = asyncio.ensure_future(self._stream_one(raw, context, out))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    task.add_done_callback(lambda _: room.release())
                while running:
                    await asyncio.wait(set(running))
            finally:
                out.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await out.get()) is not None:
                yield item
            await reader   # its failure (the client's side broken) ends the call with it
        finally:
            for task in (reader, *running):
                task.cancel()
            await asyncio.gather(reader, *running, return_exceptions=True)

    async def _check_key(self, context: Context) -> None:
        """A stream's caller needs a valid key (with keys on) before any of its requests is read."""
        headers = {k: v for k, v in context.invocation_metadata() or () if k == "authorization"}
        try:
            self.gateway.auth.check_key(headers.get("authorization"))
        except Unauthenticated as err:
            await _abort(context, _Refusal(err))

    async def _stream_one(self, raw: bytes, context: Context, out: asyncio.Queue[bytes | None]) -> None:
        try:
            response = await self._run("ModelStreamInfer", context, message=raw)
            if isinstance(response, _Refusal):
                out.put_nowait(encode_stream_error(response.details))
                return
            assert isinstance(response, StreamingResponse)
            replies: AsyncIterator[bytes] = response.body_iterator  # type: ignore[assignment]
            async with contextlib.aclosing(replies):   # type: ignore[type-var]
                async for reply in replies:
                    out.put_nowait(reply)
        except Exception as exc:   # a bug: logged, and this request answered as HTTP answers 500
            out.put_nowait(encode_stream_error(internal_error(exc, "gRPC ModelStreamInfer").message))

    # --- the guarded handlers of ModelInfer and ModelStreamInfer ---------------------------------------------

    async def _decoded(self, request: Request) -> tuple[ModelContract, GrpcInfer]:
        """The request's model and tensors, checked as V2 infer checks a body's."""
        gateway = gateway_of(request)
        raw: bytes = request.scope[MESSAGE]
        _claim(request, gateway, len(raw))
        with gateway.tracer.start("decode"):
            message = await off_loop(len(raw), parse_message, raw)
            if not message.model_name:
                raise InvalidInput("model_name: missing")
            contract = gateway.service.contract(message.model_name, message.model_version or None)
            label_model(request, contract.key)
            parsed = await off_loop(len(raw), decode_infer, message, contract)
            validate_inputs(contract, parsed.inputs)
        await check_prompts(contract, [parsed.inputs])
        return contract, parsed

    async def _infer(self, request: Request) -> Response:
        gateway = gateway_of(request)
        contract, parsed = await self._decoded(request)
        result = await gateway.service.infer(contract, parsed.inputs, when_full="reject")
        assert isinstance(result, InferResult)   # "reject": no room is Overloaded, never a job
        outputs = one_row(result.outputs) if generates_text(contract) else result.outputs
        served = {"ember_rung": result.rung.value, "ember_instance": result.instance_id}
        with gateway.tracer.start("encode"):
            payload = await off_loop(sum(a.nbytes for a in outputs.values()), encode_infer, contract, parsed,
                                     outputs, served)
        return Response(payload, headers={"Ember-Rung": result.rung.value, "Ember-Instance": result.instance_id})

    async def _open_stream(self, request: Request) -> Response:
        gateway = gateway_of(request)
        contract, parsed = await self._decoded(request)
        stream = await gateway.service.stream(contract, parsed.inputs, when_full="reject")
        return StreamingResponse(_replies(contract, parsed, stream, gateway.metrics),
                                 headers={"Ember-Rung": stream.rung.value, "Ember-Instance": stream.instance_id})


async def _replies(contract: ModelContract, parsed: GrpcInfer, stream: InferStream,
                   meter: GenerationMeter) -> AsyncIterator[bytes]:
    """A stream request's replies as ModelStreamInferResponse messages; a text generation's tokens are timed as
    over SSE. A failure after the first reply is an in-band error."""
    timing = _Timing(meter, contract.key) if generates_text(contract) else None
    if timing is not None:
        timing.opened(stream.rung)
    served = {"ember_rung": stream.rung.value, "ember_instance": stream.instance_id}
    try:
        async for outputs in stream:
            if timing is not None:
                timing.reply(outputs)
            yield encode_stream_reply(contract, parsed, outputs, served)
            served = {}
        if parsed.final_response:
            yield encode_stream_end(contract, parsed)
    except EmberError as err:
        yield encode_stream_error(client_message(err))
    finally:
        if timing is not None:
            timing.ended()
        stream.on_close()
        with contextlib.suppress(BaseException):
            await stream.aclose()


def _claim(request: Request, gateway: Gateway, size: int) -> None:
    """A request message within max_body_bytes, claimed from the in-flight budget with what decoding it makes."""
    if size > gateway.max_body_bytes:
        raise PayloadTooLarge(f"request message of {size} bytes exceeds the limit of {gateway.max_body_bytes} "
                              "bytes (max_body_bytes)")
    gateway.budget.claim(request, min(2 * size, gateway.budget.limit))


async def _abort(context: Context, refusal: _Refusal) -> NoReturn:
    await context.abort(refusal.code, refusal.details, trailing_metadata=refusal.trailing)
    raise AssertionError("unreachable: abort raises")


def _unexpected(name: str, rpc: Callable[[bytes, Context], Awaitable[bytes]]) -> Callable[..., Awaitable[bytes]]:
    """A bug outside the guard (reading a message, writing the answer) is logged and answered INTERNAL, its text
    kept from the client, as HTTP answers 500."""
    async def run(raw: bytes, context: Context) -> bytes:
        try:
            return await rpc(raw, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            err = internal_error(exc, f"gRPC {name}")
            await context.abort(Code.INTERNAL, err.message)
            raise AssertionError("unreachable: abort raises") from None

    return run


def _model(name: str, version: str) -> dict[str, str]:
    return {"model": name, "version": version} if version else {"model": name}


def _parameter(param: pb.ModelRepositoryParameter) -> Any:
    choice = param.WhichOneof("parameter_choice")
    value = getattr(param, choice) if choice else None
    return base64.b64encode(value).decode() if isinstance(value, bytes) else value


def _peer(peer: str) -> list[Any] | None:
    """gRPC's peer ("ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000") as an ASGI client address."""
    kind, _, rest = peer.partition(":")
    host, _, port = urllib.parse.unquote(rest).rpartition(":")
    return [host.strip("[]"), int(port)] if kind in ("ipv4", "ipv6") and port.isdigit() else None


def _receiver(body: bytes) -> Callable[[], Awaitable[dict[str, Any]]]:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()   # no disconnect: a gone client cancels the RPC's task instead
        return {"type": "http.disconnect"}

    return receive
