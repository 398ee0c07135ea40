"""V2 REST: metadata, health, JSON infer, repository, and errors naming what is wrong."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from ember.errors import DeadlineExceeded, ModelFailed, ModelNotReady, OutputMismatch, Overloaded, WorkerCrashed
from ember.testing.service import FakeService, fake_embedding


def x_input(data: Any, shape: list[int] | None = None, datatype: str = "FP32", name: str = "x") -> dict[str, Any]:
    return {"name": name, "shape": shape if shape is not None else [2, 3], "datatype": datatype, "data": data}


def test_server_metadata_and_health(client: TestClient, service: FakeService) -> None:
    meta = client.get("/v2").json()
    assert meta["name"] == "ember" and {"binary_tensor_data", "model_repository"} <= set(meta["extensions"])
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
    service.ready = False
    r = client.get("/v2/health/ready")
    assert r.status_code == 503 and "not ready" in r.json()["error"]


def test_model_metadata_from_the_contract(client: TestClient) -> None:
    for url in ("/v2/models/affine", "/v2/models/affine/versions/1"):
        meta = client.get(url).json()
        assert meta == {"name": "affine", "versions": ["1"], "platform": "python",
                        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
                        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]},
                                    {"name": "norm", "datatype": "FP64", "shape": [-1]}]}
    r = client.get("/v2/models/affine/versions/9")
    assert r.status_code == 404 and "version '9'" in r.json()["error"]
    assert client.get("/v2/models/nope").status_code == 404


def test_model_ready_follows_load_and_unload(client: TestClient) -> None:
    assert client.get("/v2/models/echo/ready").status_code == 200
    assert client.post("/v2/repository/models/echo/unload", json={"parameters": {"unload_dependents": False}}
                       ).status_code == 200
    assert client.get("/v2/models/echo/ready").status_code == 503
    assert client.get("/v2/health/ready").status_code == 503
    index = client.post("/v2/repository/index", content=b"").json()
    assert {"name": "echo", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in index
    ready_only = client.post("/v2/repository/index", json={"ready": True}).json()
    assert sorted(e["name"] for e in ready_only) == ["affine", "chatter", "embedder"]
    assert client.post("/v2/repository/models/echo/load").status_code == 200
    assert client.get("/v2/models/echo/ready").status_code == 200
    r = client.post("/v2/repository/models/nope/load")
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = client.post("/v2/repository/models/echo/load", json={"parameters": {"config": "{}"}})
    assert r.status_code == 400 and "parameters.config" in r.json()["error"]


def test_infer_json_flat_and_nested_echoes_id(client: TestClient) -> None:
    for data in ([1, 2, 3, 4, 5, 6], [[1, 2, 3], [4, 5, 6]]):
        r = client.post("/v2/models/affine/infer", json={"id": "req-7", "inputs": [x_input(data)]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "req-7" and body["model_name"] == "affine" and body["model_version"] == "1"
        y = next(o for o in body["outputs"] if o["name"] == "y")
        assert y == {"name": "y", "datatype": "FP32", "shape": [2, 3], "data": [3, 5, 7, 9, 11, 13]}
        assert r.headers["ember-rung"] == "hot"


def test_infer_requested_outputs_only(client: TestClient) -> None:
    r = client.post("/v2/models/affine/infer", json={"inputs": [x_input([0, 0, 0], [1, 3])],
                                                     "outputs": [{"name": "norm"}]})
    assert [o["name"] for o in r.json()["outputs"]] == ["norm"]
    assert r.json()["outputs"][0]["data"] == pytest.approx([np.sqrt(3)])
    assert "id" not in r.json()


def test_infer_bytes_as_json_strings(client: TestClient) -> None:
    r = client.post("/v2/models/echo/infer", json={"inputs": [x_input(["héllo", "ab"], [2], "BYTES", "text")]})
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert out["upper"]["data"] == ["HéLLO", "AB"] and out["upper"]["datatype"] == "BYTES"
    assert out["length"]["data"] == [6, 2]
    r = client.post("/v2/models/embedder/infer", json={"inputs": [x_input(["a b"], [1], "BYTES", "text")]})
    emb = next(o for o in r.json()["outputs"] if o["name"] == "embedding")
    assert emb["shape"] == [1, 8] and np.allclose(emb["data"], fake_embedding(b"a b"))


def test_infer_on_a_text_generation_answers_its_declared_one_row(client: TestClient, service: FakeService) -> None:
    """A streaming model's replies (chatter's: one per word) answer V2 infer as the one row its contract declares
    ([1] each): the whole text, the last finish reason, the final counts, every logprobs entry in one list; and so
    does the job of an async infer."""
    request = json.dumps({"prompt": "one two three", "logprobs": True, "top_logprobs": 1})
    body = {"inputs": [x_input([request], [1], "BYTES", "request")]}
    declared = {o.name: list(o.shape) for o in service.contract("chatter").outputs}
    r = client.post("/v2/models/chatter/infer", json=body)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert {name: o["shape"] for name, o in out.items()} == declared == {name: [1] for name in declared}
    assert out["text"]["data"] == ["one two three "] and out["finish_reason"]["data"] == ["stop"]
    assert out["completion_tokens"]["data"] == [3] and out["prompt_tokens"]["data"] == [6]
    assert [e["token"] for e in json.loads(out["logprobs"]["data"][0])] == ["one ", "two ", "three "]
    assert out["tool_calls"]["data"] == [""]
    r = client.post("/v2/models/chatter/infer", json=body, headers={"Prefer": "respond-async"})
    assert r.status_code == 202 and service.run_jobs() == 1
    job = client.get(r.headers["location"]).json()
    assert {o["name"]: o["data"] for o in job["response"]["outputs"]} == {n: o["data"] for n, o in out.items()}


@pytest.mark.parametrize(("request_body", "status", "needle"), [
    ({"inputs": [x_input([1, 2, 3])]}, 400, "input 'x': shape [2, 3] needs 6 elements, data has 3"),
    ({"inputs": [x_input([1, 2, 3], [1, 3], "INT32")]}, 400, "input 'x': datatype INT32 does not match"),
    ({"inputs": [x_input([1, 2, 3, 4], [1, 4])]}, 400, "input 'x': shape [1, 4] does not match the contract's [-1, 3]"),
    ({"inputs": [x_input(["a", "b", "c"], [1, 3])]}, 400, "input 'x': data hold string values, not FP32"),
    ({"inputs": [x_input([1, 2, 3], [1, 3], "FP99")]}, 400, "input 'x': unknown datatype 'FP99'"),
    ({"inputs": [x_input([1, 2, 3], [1, 3], name="z")]}, 400, "input 'z': model 'affine' has no such input"),
    ({"inputs": [x_input([1, 2, 3], [1, -3])]}, 400, "input 'x': shape [1, -3] has a negative dimension"),
    ({"inputs": [x_input([1, 2, 3], [1, 3]), x_input([1, 2, 3], [1, 3])]}, 400, "input 'x': given more than once"),
    ({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32"}]}, 400, "input 'x': no data"),
    ({"inputs": [x_input(7, [1])]}, 400, "input 'x': data must be a JSON array"),
    ({"inputs": []}, 400, "inputs"),
    ({"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]}, 400, "inputs[0].name"),
    ({"inputs": [x_input([1, 2, 3], [1, 3])], "outputs": [{"name": "zz"}]}, 400, "output 'zz': model 'affine' has no"),
    ({"inputs": [x_input([1, 2, 3], [1, 3])], "parameters": {"binary_data_output": "yes"}}, 400,
     "parameters.binary_data_output"),
])
def test_bad_infer_requests_name_the_field(client: TestClient, request_body: dict[str, Any], status: int,
                                           needle: str) -> None:
    r = client.post("/v2/models/affine/infer", json=request_body)
    assert r.status_code == status
    assert needle in r.json()["error"], r.json()


def test_integer_range_and_kind_checks() -> None:
    from ember.errors import InvalidInput
    from ember.gateway.v2_codec import decode_json_tensor
    from ember.wire.v2 import InferInputTensor

    ok = decode_json_tensor(InferInputTensor(name="i", shape=[3], datatype="UINT8", data=[0, 1, 255]))
    assert ok.dtype == np.uint8 and list(ok) == [0, 1, 255]
    with pytest.raises(InvalidInput, match="input 'i': a value lies outside the range of UINT8"):
        decode_json_tensor(InferInputTensor(name="i", shape=[1], datatype="UINT8", data=[256]))
    with pytest.raises(InvalidInput, match="input 'i': data hold floating-point values, not INT64"):
        decode_json_tensor(InferInputTensor(name="i", shape=[1], datatype="INT64", data=[1.5]))
    with pytest.raises(InvalidInput, match="input 'b': data hold integer values, not BOOL"):
        decode_json_tensor(InferInputTensor(name="b", shape=[1], datatype="BOOL", data=[1]))
    with pytest.raises(InvalidInput, match="input 't': BYTES data in JSON are strings; element 1 is int"):
        decode_json_tensor(InferInputTensor(name="t", shape=[2], datatype="BYTES", data=["a", 1]))
    flags = decode_json_tensor(InferInputTensor(name="b", shape=[1, 2], datatype="BOOL", data=[[True, False]]))
    assert flags.dtype == np.bool_ and flags.shape == (1, 2)


@pytest.mark.parametrize(("datatype", "value"), [("FP32", 1e39), ("FP32", -3.5e38), ("FP16", 70000), ("FP16", 65520.0)])
def test_a_finite_value_past_a_float_types_range_is_a_400(client: TestClient, datatype: str, value: float) -> None:
    """It would have become an infinity (found by tests/unit/gateway/test_fuzz.py at 1,500 examples)."""
    from ember.errors import InvalidInput
    from ember.gateway.v2_codec import decode_json_tensor
    from ember.wire.v2 import InferInputTensor

    with pytest.raises(InvalidInput, match=f"input 'x': a value lies outside the range of {datatype}"):
        decode_json_tensor(InferInputTensor(name="x", shape=[2], datatype=datatype, data=[1.0, value]))
    top = float(np.finfo(np.float32 if datatype == "FP32" else np.float16).max)
    held = decode_json_tensor(InferInputTensor(name="x", shape=[3], datatype=datatype, data=[top, -top, 1]))
    assert np.isfinite(held).all()
    r = client.post("/v2/models/affine/infer", json={"inputs": [x_input([1.0, 2.0, 1e39], [1, 3])]})
    assert r.status_code == 400 and r.json()["error"] == "input 'x': a value lies outside the range of FP32"


def test_malformed_json_and_wrong_shapes_of_body(client: TestClient) -> None:
    r = client.post("/v2/models/affine/infer", content=b'{"inputs": [')
    assert r.status_code == 400 and r.json()["error"].startswith("malformed JSON: ")
    r = client.post("/v2/models/affine/infer", content=b"[1, 2]")
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]
    r = client.post("/v2/models/affine/infer", content=b"\xff\xff")
    assert r.status_code == 400 and r.json()["error"].startswith("malformed JSON: ")
    r = client.post("/v2/models/affine/infer", content=b"\xff\xfe")   # UTF-16LE's byte order mark: not UTF-8
    assert r.status_code == 415 and "UTF-16LE" in r.json()["error"]


def test_unknown_model_and_route(client: TestClient) -> None:
    r = client.post("/v2/models/nope/infer", json={"inputs": [x_input([1, 2, 3], [1, 3])]})
    assert r.status_code == 404 and r.json() == {"error": "model 'nope' is not deployed"}
    r = client.get("/v2/nothing/here")
    assert r.status_code == 404 and "error" in r.json()
    assert client.get("/v2/models/affine/infer").status_code == 405


@pytest.mark.parametrize(("failure", "status"), [
    (Overloaded("queue full", retry_after=2.2), 429),
    (ModelNotReady("model 'affine:1': failed to start"), 503),
    (DeadlineExceeded("model 'affine:1': deadline of 1.0 s passed"), 504),
    (WorkerCrashed("model 'affine:1': instance i-3 died (signal 9)"), 502),
])
def test_service_errors_map_to_status(client: TestClient, service: FakeService, failure: Exception,
                                      status: int) -> None:
    service.failure = failure
    r = client.post("/v2/models/affine/infer", json={"inputs": [x_input([1, 2, 3], [1, 3])]})
    assert r.status_code == status and r.json() == {"error": str(failure)}
    if status == 429:
        assert r.headers["retry-after"] == "3"


def test_a_models_exception_is_500_without_its_text_which_the_log_keeps(
        client: TestClient, service: FakeService, caplog: pytest.LogCaptureFixture) -> None:
    """A model's exception text (paths, inputs, internals: `probability tensor contains inf/nan`) never reaches
    the client; an incident id ties the 500 to the log line that has it."""
    service.failure = ModelFailed("RuntimeError: probability tensor contains inf/nan at /srv/secret/model.py")
    r = client.post("/v2/models/affine/infer", json={"inputs": [x_input([1, 2, 3], [1, 3])]})
    assert r.status_code == 500 and "secret" not in r.text and "inf/nan" not in r.text
    incident = r.json()["error"].split("incident ")[1].split(";")[0]
    assert r.json()["error"].startswith("the model failed on this request (incident ")
    assert any(incident in rec.getMessage() and "inf/nan" in rec.getMessage() for rec in caplog.records)
    o = client.post("/v1/embeddings", json={"model": "embedder", "input": "a"})
    assert o.status_code == 500 and "inf/nan" not in o.text and o.json()["error"]["type"] == "server_error"
    service.failure = OutputMismatch("model 'affine:1': output 'y': datatype FP64 does not match the contract's FP32")
    r = client.post("/v2/models/affine/infer", json={"inputs": [x_input([1, 2, 3], [1, 3])]})
    assert r.status_code == 500 and "output 'y'" in r.json()["error"]   # ember's own words: kept


def test_unexpected_exception_is_500_without_detail(client: TestClient, service: FakeService,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    service.failure = RuntimeError("secret internal detail")
    r = client.post("/v2/models/affine/infer", json={"inputs": [x_input([1, 2, 3], [1, 3])]})
    assert r.status_code == 500 and r.json() == {"error": "internal error"}
    assert "secret" not in r.text
    assert any("secret internal detail" in (rec.exc_text or "") for rec in caplog.records)
