"""Triton's model configuration extension, `GET /v2/models/{m}[/versions/{v}]/config`, read by the real
tritonclient.http over a real uvicorn server and FakeService (was a 404: tritonclient's get_model_config and
perf_analyzer call it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from ember.gateway.app import create_app
from ember.metrics import Metrics
from ember.testing.asgi import ThreadedServer
from ember.testing.service import FakeService


@pytest.fixture
def tc() -> Iterator[triton.InferenceServerClient]:
    with ThreadedServer(create_app(FakeService(), Metrics())) as server:
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
        yield client
        client.close()


def test_get_model_config_answers_tritons_shape_from_the_contract(tc: triton.InferenceServerClient) -> None:
    assert "model_configuration" in tc.get_server_metadata()["extensions"]
    assert tc.get_model_config("affine") == {
        "name": "affine", "platform": "python", "backend": "python", "max_batch_size": 4096,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [3]},
                   {"name": "norm", "data_type": "TYPE_FP64", "dims": [1], "reshape": {"shape": []}}],
        "instance_group": [{"name": "affine", "count": 4, "kind": "KIND_CPU"}]}
    chatter = tc.get_model_config("chatter", model_version="1")
    assert chatter["max_batch_size"] == 0 and chatter["input"] == [{"name": "request", "data_type": "TYPE_STRING",
                                                                    "dims": [1]}]
    embedder = tc.get_model_config("embedder")
    assert embedder["dynamic_batching"] == {"preferred_batch_size": [], "max_queue_delay_microseconds": 2000}
    assert embedder["output"][0]["dims"] == [8]


def test_an_unknown_model_or_version_is_a_404_naming_it(tc: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="model 'nope' is not deployed") as err:
        tc.get_model_config("nope")
    assert err.value.status() == "404"
    with pytest.raises(InferenceServerException, match="model 'affine' version '9' is not deployed"):
        tc.get_model_config("affine", model_version="9")
