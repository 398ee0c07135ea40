"""The V2 binary tensor extension, both ways, built by hand (the real client is in integration)."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
from starlette.testclient import TestClient

from ember.testing.service import fake_embedding
from ember.wire.tensors import from_raw, to_raw

HEADER = "Inference-Header-Content-Length"


def binary_request(header: dict[str, Any], *blobs: bytes) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + b"".join(blobs), {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}


def split_response(body: bytes, header_length: str) -> tuple[dict[str, Any], bytes]:
    n = int(header_length)
    return json.loads(body[:n]), body[n:]


def test_binary_inputs_and_outputs(client: TestClient) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    raw = to_raw(x)
    body, headers = binary_request({
        "inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "parameters": {"binary_data_size": len(raw)}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}, {"name": "norm"}],
    }, raw)
    r = client.post("/v2/models/affine/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    head, tail = split_response(r.content, r.headers[HEADER])
    y_meta, norm_meta = head["outputs"]
    assert y_meta["parameters"]["binary_data_size"] == len(tail) == 24 and "data" not in y_meta
    assert np.array_equal(from_raw(tail, "FP32", (2, 3), "y"), x * 2 + 1)
    assert norm_meta["data"] == list(np.linalg.norm((x * 2 + 1).astype(np.float64), axis=1))


def test_binary_bytes_input_and_binary_data_output_default(client: TestClient) -> None:
    texts = np.array([b"one", b"two words", "d\u00e9j\u00e0".encode()], dtype=object)
    raw = to_raw(texts)
    body, headers = binary_request({
        "parameters": {"binary_data_output": True},
        "inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}}],
    }, raw)
    r = client.post("/v2/models/embedder/infer", content=body, headers=headers)
    head, tail = split_response(r.content, r.headers[HEADER])
    sizes = {o["name"]: o["parameters"]["binary_data_size"] for o in head["outputs"]}
    assert [o["name"] for o in head["outputs"]] == ["embedding", "token_count"]
    emb = from_raw(tail[: sizes["embedding"]], "FP32", (3, 8), "embedding")
    assert np.allclose(emb[2], fake_embedding("d\u00e9j\u00e0".encode()))
    counts = from_raw(tail[sizes["embedding"]:], "INT64", (3,), "token_count")
    assert list(counts) == [3, 4, 3]


def test_binary_input_with_an_output_asked_as_json(client: TestClient) -> None:
    texts = np.array([b"ab"], dtype=object)
    raw = to_raw(texts)
    body, headers = binary_request({
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}}],
        "outputs": [{"name": "upper", "parameters": {"binary_data": False}}],
    }, raw)
    r = client.post("/v2/models/echo/infer", content=body, headers=headers)
    assert HEADER not in r.headers and r.json()["outputs"][0]["data"] == ["AB"]


def bad(client: TestClient, body: bytes, headers: dict[str, str]) -> str:
    r = client.post("/v2/models/affine/infer", content=body, headers=headers)
    assert r.status_code == 400, r.text
    return str(r.json()["error"])


def test_binary_errors_name_the_input(client: TestClient) -> None:
    raw = to_raw(np.zeros((1, 3), np.float32))
    spec = {"name": "x", "shape": [1, 3], "datatype": "FP32"}
    body, headers = binary_request({"inputs": [{**spec, "parameters": {"binary_data_size": 100}}]}, raw)
    assert "input 'x': binary_data_size 100 overruns the 12 binary bytes left" in bad(client, body, headers)
    body, headers = binary_request({"inputs": [{**spec, "parameters": {"binary_data_size": 12}}]}, raw, b"more")
    assert "binary data: 4 trailing bytes" in bad(client, body, headers)
    body, headers = binary_request({"inputs": [{**spec, "shape": [1, 2], "parameters": {"binary_data_size": 12}}]},
                                   raw)
    assert "input 'x': 12 bytes do not hold shape [1, 2] of FP32" in bad(client, body, headers)
    body, headers = binary_request({"inputs": [{**spec, "parameters": {"binary_data_size": "12"}}]}, raw)
    assert "input 'x': binary_data_size must be a non-negative integer" in bad(client, body, headers)
    body, headers = binary_request({"inputs": [{**spec, "data": [1, 2, 3], "parameters": {"binary_data_size": 12}}]},
                                   raw)
    assert "input 'x': has both 'data' and parameters.binary_data_size" in bad(client, body, headers)
    head = json.dumps({"inputs": [{**spec, "parameters": {"binary_data_size": 12}}]}).encode()
    assert "no Inference-Header-Content-Length" in bad(client, head, {})
    assert "Inference-Header-Content-Length: 9999 is outside" in bad(client, head, {HEADER: "9999"})
    assert "Inference-Header-Content-Length: not an integer" in bad(client, head, {HEADER: "x"})


def test_a_huge_binary_shape_is_a_400_naming_the_input(client: TestClient) -> None:
    body, headers = binary_request({"inputs": [{"name": "x", "shape": [2**32, 2**32], "datatype": "FP32",
                                                "parameters": {"binary_data_size": 0}}]})
    assert "input 'x': shape [4294967296, 4294967296] is too large" in bad(client, body, headers)


def test_bytes_truncated_in_binary(client: TestClient) -> None:
    raw = struct.pack("<I", 10) + b"abc"
    body, headers = binary_request({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                                "parameters": {"binary_data_size": len(raw)}}]}, raw)
    r = client.post("/v2/models/echo/infer", content=body, headers=headers)
    assert r.status_code == 400 and "input 'text': BYTES element overruns the buffer" in r.json()["error"]


def test_non_utf8_output_asked_as_json_says_use_binary(client: TestClient) -> None:
    raw = to_raw(np.array([b"\xff\xfe"], dtype=object))
    body, headers = binary_request({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                                "parameters": {"binary_data_size": len(raw)}}]}, raw)
    r = client.post("/v2/models/echo/infer", content=body, headers=headers)
    assert r.status_code == 400 and "output 'upper'" in r.json()["error"] and "binary_data" in r.json()["error"]
    body, headers = binary_request({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                                "parameters": {"binary_data_size": len(raw)}}],
                                    "parameters": {"binary_data_output": True}}, raw)
    r = client.post("/v2/models/echo/infer", content=body, headers=headers)
    head, tail = split_response(r.content, r.headers[HEADER])
    assert list(from_raw(tail[: head["outputs"][0]["parameters"]["binary_data_size"]], "BYTES", (1,), "u")) == [
        b"\xff\xfe"]
