"""A fuzzer over every request body the gateway parses: valid-ish JSON documents, mutated (a field replaced by
any JSON value, dropped, an unknown one added, strings with lone surrogates, nested nulls, deep nesting, huge or zero
shapes, numbers past any range, raw bytes cut or spliced), in UTF-8 or in the UTF-16 and UTF-32 an RFC 8259 decoder
may detect, with or without a byte order mark. Whatever comes in, the answer is never a 5xx, and a 4xx names what
it is about. EMBER_FUZZ_EXAMPLES sets the examples per test (default 120); bench/fuzz_serve.py runs 20,000
requests against a real server."""

from __future__ import annotations

import codecs
import copy
import json
import os
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
from ember.jobs.store import JobStore
from ember.metrics import Metrics
from ember.testing.service import FakeService

FUZZ = settings(max_examples=int(os.environ.get("EMBER_FUZZ_EXAMPLES", "120")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Strings a client may send that break whoever meets them: lone surrogates, NULs, odd Unicode.
_nasty_text = st.sampled_from(["\ud800", "a\udfff", "\x00", "\u202e", "😀", "", " ", "é" * 40])
_text = st.text(max_size=12) | _nasty_text
_ints = st.integers() | st.sampled_from([0, -1, 2**31, 2**63, 10**30, -(10**30)])
# Numbers no float or machine integer holds, and one past Python's 4,300-digit limit on int(): each a placeholder
# string in the document, written into the JSON text as the bare number.
_HUGE = {"<huge:digits>": "9" * 5000, "<huge:exp>": "1e999", "<huge:tiny>": "-1e-999", "<huge:int>": "1" + "0" * 400,
         "<huge:frac>": "123456789012345678901234567890.5e300"}
_scalar = st.none() | st.booleans() | _ints | st.floats() | _text | st.sampled_from(list(_HUGE))
# The encodings an RFC 8259 decoder may detect (by a byte order mark, or the NULs around the first character).
_NOT_UTF8 = [("utf-16-le", b""), ("utf-16-le", codecs.BOM_UTF16_LE), ("utf-16-be", b""),
             ("utf-16-be", codecs.BOM_UTF16_BE), ("utf-32-le", b""), ("utf-32-le", codecs.BOM_UTF32_LE),
             ("utf-32-be", b""), ("utf-32-be", codecs.BOM_UTF32_BE)]
_encoding = st.sampled_from([("utf-8", b""), ("utf-8", codecs.BOM_UTF8)]) | st.sampled_from(_NOT_UTF8)
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
    text = json.dumps(doc, allow_nan=True, ensure_ascii=draw(st.booleans()))   # a lone surrogate raw or escaped
    for placeholder, number in _HUGE.items():
        text = text.replace(json.dumps(placeholder), number)
    if kind == "deep":
        text = text[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    codec, bom = draw(_encoding) if draw(st.integers(0, 3)) == 0 else ("utf-8", b"")
    raw = bom + text.encode(codec, "surrogatepass")
    if kind == "cut":
        return raw[: draw(st.integers(0, len(raw)))]
    if kind == "splice":
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.binary(max_size=8) | st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\\ud800",
                                                                         b"\xff\xfe", b"\x00\x00"])) + raw[at:]
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
_name = st.sampled_from(["get_weather", "get_time", "", "x" * 300]) | _text
_schema = st.sampled_from([{}, {"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}}},
                           {"$ref": "#/$defs/missing"}, {"anyOf": []}, {"type": ["string", "null"]},
                           {"type": "array"}, {"enum": []}]) | _json
_tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "custom"]),
                               "function": st.fixed_dictionaries({"name": _name},
                                                                 optional={"description": _text, "parameters": _schema,
                                                                           "strict": _json})})
_call = st.fixed_dictionaries({"id": _text, "type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": _name, "arguments": _text | _json})})
_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url", "input_audio", "refusal"])},
                              optional={"text": _text | _json, "image_url": _json})
_content = _text | st.none() | st.lists(_part, max_size=3)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "developer", "assistant", "tool", "function"]), "content": _content},
    optional={"tool_calls": st.lists(_call, max_size=2) | st.none(), "tool_call_id": _text | st.none(),
              "name": _text | st.none(), "refusal": _json})
_tool_choice = st.sampled_from(["none", "auto", "required", "any"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": _name})}) | _json
_response_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
    optional={"json_schema": st.fixed_dictionaries({"name": _name}, optional={"schema": _schema, "strict": _json})})
_openai_extras = {"logprobs": st.booleans() | st.none() | _ints, "top_logprobs": _ints | st.none(),
                  "logit_bias": st.dictionaries(st.sampled_from(["1", "42", "x", "-1", "99999999999"]),
                                                st.floats() | _ints, max_size=3) | _json,
                  "user": _text | st.none(), "metadata": _json, "store": _json, "service_tier": _json,
                  "frequency_penalty": st.none() | st.floats(), "presence_penalty": st.none() | st.floats()}
_chat = st.fixed_dictionaries(
    {"model": st.sampled_from(["chatter", "embedder", "nope"]), "messages": st.lists(_message, max_size=3)},
    optional={**_sampling, **_openai_extras, "stream": st.booleans(), "n": _ints | st.sampled_from([2, 3, 16]),
              "max_completion_tokens": _ints, "stream_options": st.fixed_dictionaries({"include_usage": _json}),
              "tools": st.lists(_tool, max_size=3) | st.none(), "tool_choice": _tool_choice,
              "parallel_tool_calls": _json, "response_format": _response_format | _json,
              "modalities": _json, "prediction": _json, "functions": _json, "audio": _json},
)
_completion = st.fixed_dictionaries(
    {"model": st.sampled_from(["chatter", "nope"]),
     "prompt": _text | st.lists(_text, max_size=3) | st.lists(_ints, max_size=3)},
    optional={**_sampling, **_openai_extras, "stream": st.booleans(), "echo": st.booleans() | st.none(),
              "n": st.sampled_from([1, 2, 65]) | _ints, "best_of": _ints | st.none(), "suffix": _text | st.none(),
              "max_tokens": st.sampled_from([0, 1, 2]) | _ints},
)
_generate = st.fixed_dictionaries(
    {"text_input": _text}, optional={"parameters": st.fixed_dictionaries({}, optional={
        **_sampling, "logprobs": _json, "top_logprobs": _ints, "logit_bias": _json, "random_seed": _json}),
        **_sampling, "logprobs": st.booleans(), "id": _text, "exclude_input_in_output": _json},
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
_NAMES_A_FIELD = re.compile(r"^(\S.{0,200}?: |model '.*'( version '.*')? is not deployed)", re.DOTALL)


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
@given(body=_chat, stream=st.booleans())
def test_openai_chat_structured_but_odd(client: TestClient, body: dict[str, Any], stream: bool) -> None:
    """Every OpenAI field a client may send, each with a plausible or odd value, unmutated: never a 5xx, and when
    accepted, an answer (or a stream) in OpenAI's shape."""
    r = client.post("/v1/chat/completions", content=json.dumps({**body, "stream": stream}).encode(),
                    headers={"content-type": "application/json"})
    _check("/v1/chat/completions", r.status_code, r.json() if not stream or r.status_code != 200 else {})
    if r.status_code == 200 and not stream:
        assert r.json()["object"] == "chat.completion" and r.json()["choices"]
    elif r.status_code == 200:
        assert r.text.rstrip().endswith("data: [DONE]") or '"error"' in r.text


@FUZZ
@given(body=_completion)
def test_openai_completion_structured_but_odd(client: TestClient, body: dict[str, Any]) -> None:
    r = client.post("/v1/completions", content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    streamed = r.headers.get("content-type", "").startswith("text/event-stream")
    _check("/v1/completions", r.status_code, {} if streamed else r.json())


@FUZZ
@given(model=_text | st.sampled_from(["chatter", "chatter:1", "chatter:", ":1", "a:b:c"]))
def test_openai_model_cards(client: TestClient, model: str) -> None:
    r = client.get("/v1/models/" + urllib.parse.quote(model.encode("utf-8", "replace"), safe=""))
    _check("/v1/models/{id}", r.status_code, r.json())


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


# UTF-8's encoding of a surrogate (0xED 0xA0-0xBF ..) is not UTF-8, yet json.loads decodes bytes with
# 'surrogatepass' and hands out the lone surrogate: found by bench/fuzz_serve.py as a 500 on embeddings.
_RAW_SURROGATE = [
    ("/v1/embeddings", b'{"model": "embedder", "input": "a s\xed\xa0\x80entence"}', "input"),
    ("/v1/chat/completions", b'{"model": "chatter", "messages": [{"role": "user", "content": "\xed\xbf\xbf"}]}',
     "messages"),
    ("/v2/models/echo/infer",
     b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["a\xed\xa0\x80"]}]}', "inputs"),
    ("/v2/models/chatter/generate", b'{"text_input": "\xed\xa0\x80"}', "text_input"),
]


@pytest.mark.parametrize(("path", "raw", "field"), _RAW_SURROGATE, ids=[p for p, _, _ in _RAW_SURROGATE])
def test_a_surrogates_raw_bytes_are_a_400_naming_the_field(client: TestClient, path: str, raw: bytes,
                                                           field: str) -> None:
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    message = r.json()["error"]["message"] if path.startswith("/v1") else r.json()["error"]
    assert r.status_code == 400 and message.startswith(field) and "surrogate" in message, (r.status_code, message)


# A lone surrogate in each route's text field, the body in UTF-16 or UTF-32 (json.loads decodes those, raw surrogate
# code units included, with 'surrogatepass'): was a 500 on every route (UnicodeEncodeError wherever the text was
# encoded). The gateway takes JSON in UTF-8 only (RFC 8259 section 8.1): a 415 naming the encoding.
_WITH_SURROGATE = [
    ("/v1/chat/completions", {"model": "chatter", "messages": [{"role": "user", "content": "a\ud800 b"}]}, "messages"),
    ("/v1/completions", {"model": "chatter", "prompt": "a\udfff b"}, "prompt"),
    ("/v1/embeddings", {"model": "embedder", "input": ["ok", "a\ud800"]}, "input"),
    ("/v2/models/chatter/generate", {"text_input": "a\ud800 b"}, "text_input"),
    ("/v2/models/chatter/generate_stream", {"text_input": "a\ud800 b"}, "text_input"),
    ("/v2/models/echo/infer", {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a\ud800"]}]},
     "inputs"),
]


def _message(r: Any) -> str:
    error = r.json()["error"]
    return error["message"] if isinstance(error, dict) else error


@pytest.mark.parametrize(("codec", "bom"), _NOT_UTF8, ids=[f"{c}{'+bom' if b else ''}" for c, b in _NOT_UTF8])
@pytest.mark.parametrize(("path", "doc", "field"), _WITH_SURROGATE, ids=[p for p, _, _ in _WITH_SURROGATE])
def test_json_in_utf16_or_utf32_is_a_415_naming_the_encoding(client: TestClient, path: str, doc: dict[str, Any],
                                                             field: str, codec: str, bom: bytes) -> None:
    raw = bom + json.dumps(doc, ensure_ascii=False).encode(codec, "surrogatepass")
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    name = codec.upper().replace("-LE", "LE").replace("-BE", "BE")
    assert r.status_code == 415 and name in _message(r) and "UTF-8" in _message(r), (r.status_code, r.text[:300])


@pytest.mark.parametrize("bom", [b"", codecs.BOM_UTF8], ids=["plain", "bom"])
@pytest.mark.parametrize("escaped", [True, False], ids=["escaped", "raw"])
@pytest.mark.parametrize(("path", "doc", "field"), _WITH_SURROGATE, ids=[p for p, _, _ in _WITH_SURROGATE])
def test_a_lone_surrogate_in_utf8_json_is_a_400_naming_the_field(client: TestClient, path: str,
                                                                 doc: dict[str, Any], field: str, escaped: bool,
                                                                 bom: bytes) -> None:
    """`"\\ud800"` (an escape, valid JSON) or the surrogate's raw bytes, with or without a UTF-8 byte order mark
    (which is ignored): the field is named."""
    raw = bom + json.dumps(doc, ensure_ascii=escaped).encode("utf-8", "surrogatepass")
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and _message(r).startswith(field) and "surrogate" in _message(r), r.text[:300]


def test_a_utf8_byte_order_mark_is_ignored(client: TestClient) -> None:
    raw = codecs.BOM_UTF8 + json.dumps({"model": "embedder", "input": "é"}, ensure_ascii=False).encode()
    r = client.post("/v1/embeddings", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("charset", "status"), [("utf-8", 200), ('"UTF-8"', 200), ("utf8", 200),
                                                 ("utf-16", 415), ("latin-1", 415)])
def test_a_json_charset_other_than_utf8_is_a_415(client: TestClient, charset: str, status: int) -> None:
    r = client.post("/v1/embeddings", content=json.dumps({"model": "embedder", "input": "x"}).encode(),
                    headers={"content-type": f"application/json; charset={charset}"})
    assert r.status_code == status, r.text
    if status == 415:
        assert _message(r).startswith("Content-Type: charset=") and "UTF-8" in _message(r)


@pytest.mark.parametrize(("ids", "where"), [([-(10**30)], "input[0]"), ([[1, 10**40]], "input[0][1]"),
                                            ([2**63], "input[0]")])
def test_token_ids_past_int64_are_a_400_naming_the_item(client: TestClient, ids: list[Any], where: str) -> None:
    """Found by bench/fuzz_serve.py: numpy's int64 conversion raised OverflowError, a 500."""
    r = client.post("/v1/embeddings", json={"model": "embedder", "input": ids})
    assert r.status_code == 400 and _message(r).startswith(f"{where}: token id "), r.text
