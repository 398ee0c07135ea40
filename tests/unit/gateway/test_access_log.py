"""The access log: one line per request, text or JSON, with the model, status, rung and latency."""

from __future__ import annotations

import json
import logging

import pytest
from starlette.testclient import TestClient

from ember.gateway.access_log import AccessLog
from ember.gateway.app import create_app
from ember.metrics import Metrics
from ember.testing.service import FakeService

BODY = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}]}


def client(fmt: str | None) -> TestClient:
    access = AccessLog(fmt) if fmt is not None else None  # type: ignore[arg-type]
    return TestClient(create_app(FakeService(), Metrics(), access_log=access))


def test_json_lines_name_the_model_status_rung_and_latency(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ember.access"):
        ok = client("json").post("/v2/models/affine/infer", json=BODY)
        client("json").post("/v2/models/nope/infer", json=BODY)
    assert ok.status_code == 200
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "ember.access"]
    assert [(line["model"], line["version"], line["status"]) for line in lines] == [("affine", "1", 200),
                                                                                   ("", "", 404)]
    first = lines[0]
    assert first["method"] == "POST" and first["route"] == "/v2/models/affine/infer" and first["api"] == "v2"
    assert first["rung"] == ok.headers["ember-rung"] and first["latency_ms"] >= 0
    assert first["bytes"] == int(ok.headers["content-length"])


def test_text_lines_and_off_by_default(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ember.access"):
        client("text").post("/v2/models/affine/infer", json=BODY)
        client(None).post("/v2/models/affine/infer", json=BODY)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ember.access"]
    assert line.startswith("POST /v2/models/affine/infer v2 affine:1 200 ")
    assert line.split()[6].endswith("ms")
