"""A fuzzer over every request body the gateway parses: valid-ish JSON documents, mutated (a field replaced by
any JSON value, dropped, an unknown one added, strings with lone surrogates, deep nesting, huge or zero shapes,
raw bytes cut or spliced). Whatever comes in, the answer is never a 5xx, and a 4xx names what it is about."""

from __future__ import annotations

import copy
import json
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from ember.gateway.app import create_app
from ember.jobs import JobStore
from ember.metrics import Metrics
from ember.testing.service import FakeService

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Strings a client may send that break whoever meets them: lone surrogates, NULs, odd Unicode.
_nasty_text = st.sampled_from(["\ud800", "a\udfff", "\x00", "\u202e", "😀", "", " ", "é" * 40])
_text = st.text(max_size=12) | _nasty_text
_ints = st.integers() | st.sampled_from([0, -1, 2**31, 2**63, 10**30, -(10**30)])
_scalar = st.none() | st.booleans() | _ints | st.floats() | _text
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(_text, inner, max_size=4), max_leaves=12)
_shape = st.lists(_ints | st.sampled_from([0, 3, 10**19, 2**40]), max_size=20)


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


@st.composite
def _mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]]) -> bytes:
    """A valid-ish document with a few of its fields (at any depth) replaced, dropped or added, as bytes."""
    doc = copy.deepcopy(draw(base))   # st.just hands out one shared object
    for _ in range(draw(st.integers(0, 3))):
        _mutate(draw, doc)
    kind = draw(st.sampled_from(["json", "json", "json", "deep", "cut", "splice"]))
    raw = json.dumps(doc, allow_nan=True).encode()
    if kind == "deep":
        return raw[:-1] + b', "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    if kind == "cut":
        return raw[: draw(st.integers(0, len(raw)))]
    if kind == "splice":
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.binary(max_size=8) | st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\\ud800"])) \
            + raw[at:]
    return raw


def _mutate(draw: st.DrawFn, doc: Any) -> None:
    """One change somewhere inside `doc` (a dict or list, walked from the top)."""
    target = doc
    while True:
        children = list(target.items()) if isinstance(target, dict) else list(enumerate(target))
        nested = [(k, v) for k, v in children if isinstance(v, dict | list) and v]
        if not nested or draw(st.booleans()):
            break
        target = draw(st.sampled_from(nested))[1]
    keys = list(target) if isinstance(target, dict) else list(range(len(target)))
    action = draw(st.sampled_from(["replace", "drop", "add"]))
    if action == "add" or not keys:
        if isinstance(target, dict):
            target[draw(_text)] = draw(_json)
        else:
            target.append(draw(_json))
    elif action == "drop":
        del target[draw(st.sampled_from(keys))]
    else:
        target[draw(st.sampled_from(keys))] = draw(_json | _shape)


def _tensor(name: str, datatype: str, values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "name": st.just(name), "datatype": st.just(datatype), "shape": _shape | st.just([2, 3]) | st.just([2]),
        "data": st.lists(values, max_size=6),
    })


_v2_infer = st.fixed_dictionaries(
    {"inputs": st.lists(_tensor("x", "FP32", st.floats() | _ints) | _tensor("text", "BYTES", _text), min_size=1,
                        max_size=2)},
    optional={"id": _text, "outputs": st.lists(st.fixed_dictionaries(
        {"name": st.sampled_from(["y", "norm", "upper", "nope"])},
        optional={"parameters": st.fixed_dictionaries({"binary_data": _json})}), max_size=2),
        "parameters": st.fixed_dictionaries({}, optional={"binary_data_output": _json})},
)
_embeddings = st.fixed_dictionaries(
    {"model": st.sampled_from(["embedder", "embedder:1", "affine", "nope"]),
     "input": _text | st.lists(_text, max_size=4) | st.lists(_ints, max_size=3)},
    optional={"encoding_format": st.sampled_from(["float", "base64", "hex"]), "dimensions": _ints, "user": _text},
)
_sampling = {"max_tokens": _ints, "temperature": st.floats(), "top_p": st.floats(), "seed": _ints,
             "stop": _text | st.lists(_text, max_size=5)}
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]), "content": _text})
_chat = st.fixed_dictionaries(
    {"model": st.sampled_from(["chatter", "embedder", "nope"]), "messages": st.lists(_message, max_size=3)},
    optional={**_sampling, "stream": st.booleans(), "n": _ints, "max_completion_tokens": _ints,
              "stream_options": st.fixed_dictionaries({"include_usage": _json})},
)
_completion = st.fixed_dictionaries(
    {"model": st.sampled_from(["chatter", "nope"]), "prompt": _text | st.lists(_text, max_size=2)},
    optional={**_sampling, "stream": st.booleans(), "echo": st.booleans()},
)
_generate = st.fixed_dictionaries(
    {"text_input": _text}, optional={"parameters": st.fixed_dictionaries({}, optional=_sampling)},
)
_repository = st.fixed_dictionaries({}, optional={"ready": _json, "parameters": _json})


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = Path(tmp_path_factory.mktemp("fuzz")) / "jobs.sqlite3"
    with JobStore(path, max_queued=100, result_ttl_s=60.0) as jobs, \
            TestClient(create_app(FakeService(jobs=jobs), Metrics(), max_body_bytes=4 << 20),
                       raise_server_exceptions=False) as c:
        yield c


# What a 4xx names: a field (`input`, `messages[0].content`), an input (`input 'x'`), the body or a header.
_NAMES_A_FIELD = re.compile(r"^(\S.{0,200}?: |model '[^']*' is not deployed)", re.DOTALL)


def _check(path: str, status: int, body: Any) -> None:
    assert status < 500, f"{path}: {status} {body}"
    if status >= 400:
        message = body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
        assert _NAMES_A_FIELD.match(message), f"{path}: {status}: the error names no field: {message!r}"


def _post(client: TestClient, path: str, raw: bytes, **headers: str) -> None:
    r = client.post(path, content=raw, headers={"content-type": "application/json", **headers})
    _check(path, r.status_code, r.json() if r.headers.get("content-type", "").startswith("application/json")
           else {"error": r.text.split("\n")[0].removeprefix("data: ") or "ok: stream"})


@FUZZ
@given(raw=_mutated(_v2_infer), model=st.sampled_from(["affine", "echo", "embedder"]))
def test_v2_infer_bodies(client: TestClient, raw: bytes, model: str) -> None:
    _post(client, f"/v2/models/{model}/infer", raw)


@FUZZ
@given(raw=_mutated(_v2_infer), tail=st.binary(max_size=40),
       header=st.integers(-2, 400).map(str) | st.text(alphabet="0123456789 -+.xe", max_size=6))
def test_v2_binary_bodies(client: TestClient, raw: bytes, tail: bytes, header: str) -> None:
    _post(client, "/v2/models/echo/infer", raw + tail, **{"inference-header-content-length": header})


@FUZZ
@given(raw=_mutated(_embeddings))
def test_openai_embeddings_bodies(client: TestClient, raw: bytes) -> None:
    _post(client, "/v1/embeddings", raw)


@FUZZ
@given(raw=_mutated(_chat))
def test_openai_chat_bodies(client: TestClient, raw: bytes) -> None:
    _post(client, "/v1/chat/completions", raw)


@FUZZ
@given(raw=_mutated(_completion))
def test_openai_completion_bodies(client: TestClient, raw: bytes) -> None:
    _post(client, "/v1/completions", raw)


@FUZZ
@given(raw=_mutated(_generate), route=st.sampled_from(["generate", "generate_stream"]))
def test_generate_bodies(client: TestClient, raw: bytes, route: str) -> None:
    _post(client, f"/v2/models/chatter/{route}", raw)


@FUZZ
@given(raw=_mutated(_repository), route=st.sampled_from(["index", "models/echo/load", "models/echo/unload",
                                                         "models/nope/load"]))
def test_repository_bodies(client: TestClient, raw: bytes, route: str) -> None:
    _post(client, f"/v2/repository/{route}", raw)
    client.post("/v2/repository/models/echo/load")


@FUZZ
@given(job_id=_text | st.uuids().map(str), respond_async=_mutated(_v2_infer))
def test_jobs_routes(client: TestClient, job_id: str, respond_async: bytes) -> None:
    r = client.get("/v2/jobs/" + urllib.parse.quote(job_id.encode("utf-8", "replace"), safe=""))
    _check("/v2/jobs/{id}", r.status_code, r.json() if r.status_code != 200 else {})
    _post(client, "/v2/models/affine/infer", respond_async, prefer="respond-async")
