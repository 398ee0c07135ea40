"""`/openapi.json` documents every route, and schemathesis, generating requests from it against the app over a
FakeService, never gets a server error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from starlette.routing import Route
from starlette.testclient import TestClient

from ember.gateway.app import create_app
from ember.gateway.openapi import route_table
from ember.jobs.store import JobStore
from ember.metrics import Metrics
from ember.testing.service import FakeService


def _app(tmp_path: Path) -> object:
    jobs = JobStore(tmp_path / "jobs.sqlite3", max_queued=1000, result_ttl_s=60.0)
    return create_app(FakeService(jobs=jobs), Metrics(), max_body_bytes=1 << 20)


def test_every_route_of_the_app_is_documented(tmp_path: Path) -> None:
    app = _app(tmp_path)
    served = {(m, r.path) for r in app.routes if isinstance(r, Route)  # type: ignore[attr-defined]
              for m in (r.methods or set()) - {"HEAD"}}
    assert served == set(route_table())
    with TestClient(app) as client:  # type: ignore[arg-type]
        doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and set(doc["paths"]) == {p for _, p in route_table()}
    infer = doc["paths"]["/v2/models/{model}/infer"]["post"]
    schema = infer["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/InferRequest"}
    assert "InferInputTensor" in doc["components"]["schemas"]


@pytest.fixture
def api(tmp_path: Path) -> Any:
    """A fresh app per route: an unload generated for one route must not make another's model unready (a 503)."""
    return schemathesis.openapi.from_asgi("/openapi.json", _app(tmp_path))


@pytest.mark.parametrize(("method", "path"), route_table())
def test_no_request_the_document_allows_is_a_server_error(api: Any, method: str, path: str) -> None:
    @given(case=api[path][method].as_strategy(), model=st.sampled_from(["affine", "echo", "embedder", "chatter"]),
           real=st.booleans())
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case, model: str, real: bool) -> None:
        # Half the cases name a model that exists, so that bodies reach the codecs rather than a 404.
        if case.path_parameters and "model" in case.path_parameters and real:
            case.path_parameters.update(model=model, **({"version": "1"} if "version" in case.path_parameters
                                                        else {}))
        response = case.call()
        case.validate_response(response, checks=[not_a_server_error])

    check()
