"""`ember serve --grpc-port`: KServe V2 over gRPC, driven by the real tritonclient.grpc clients (sync, asyncio and
streaming) against the bundled iris and minilm models and the `wordy` text-generation fixture, with API keys on;
and Triton's model configuration over HTTP (tritonclient.http)."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
import tritonclient.http as th
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from ember.ports import free_port
from ember.testing.server import EmberServer

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "ember" / "examples"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
IRIS_ROWS = np.array([[5.1, 3.5, 1.4, 0.2], [6.3, 3.3, 6.0, 2.5]], dtype=np.float32)


@dataclass
class Served:
    server: EmberServer
    grpc_url: str
    admin: str
    user: str

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {key or self.admin}"}


def make_key(state: Path, tenant: str, role: str) -> str:
    out = subprocess.run([sys.executable, "-m", "ember", "keys", "--state-dir", str(state), "create",
                          "--tenant", tenant, "--role", role, "--json"], capture_output=True, text=True, check=True)
    key: str = json.loads(out.stdout)["key"]
    return key


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("grpc")
    models, state = root / "models", root / "state"
    models.mkdir()
    for name in ("iris.yaml", "iris_softmax", "minilm.yaml"):
        (models / name).symlink_to(EXAMPLES / name)
    (models / "wordy.yaml").write_text((FIXTURES / "wordy.yaml").read_text().replace("delay_s: 0.05", "delay_s: 0"))
    (models / "wordy").symlink_to(FIXTURES / "wordy")
    admin, user = make_key(state, "ops", "admin"), make_key(state, "acme", "user")
    port = free_port()
    with EmberServer(state, "--models", str(models), "--auth", "on", "--grpc-port", str(port)) as server:
        yield Served(server, f"127.0.0.1:{port}", admin, user)


@pytest.fixture
def client(served: Served) -> Iterator[tg.InferenceServerClient]:
    c = tg.InferenceServerClient(served.grpc_url)
    yield c
    c.close()


def iris_input(rows: np.ndarray = IRIS_ROWS) -> tg.InferInput:
    inp = tg.InferInput("features", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)
    return inp


def text_input(name: str, texts: list[bytes]) -> tg.InferInput:
    inp = tg.InferInput(name, [len(texts)], "BYTES")
    inp.set_data_from_numpy(np.array(texts, dtype=object))
    return inp


def chat_request(content: str) -> tg.InferInput:
    return text_input("request", [json.dumps({"messages": [{"role": "user", "content": content}]}).encode()])


def test_health_metadata_configuration_and_repository(served: Served, client: tg.InferenceServerClient) -> None:
    key = served.auth()
    assert client.is_server_live() and client.is_server_ready()   # public, as over HTTP
    assert client.is_model_ready("iris", headers=key) and not client.is_model_ready("nope", headers=key)
    meta = client.get_server_metadata()
    assert meta.name == "ember" and "model_configuration" in meta.extensions
    model = client.get_model_metadata("minilm", headers=key, as_json=True)
    assert model["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1"]}]
    config = client.get_model_config("iris", headers=key).config
    assert (config.name, config.backend, config.max_batch_size) == ("iris", "python", 4096)
    assert [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in config.input] == \
        [("features", "TYPE_FP32", [4])]
    assert [model_config_pb2.DataType.Name(t.data_type) for t in config.output] == \
        ["TYPE_FP32", "TYPE_INT64", "TYPE_STRING"]
    index = client.get_model_repository_index(headers=key, as_json=True)
    assert {m["name"] for m in index["models"]} == {"iris", "minilm", "wordy"}


def test_http_model_config_is_tritons_shape_and_matches_grpc(served: Served, client: tg.InferenceServerClient) -> None:
    http = th.InferenceServerClient(served.server.url.removeprefix("http://"))
    for model in ("minilm", "wordy"):
        over_http = http.get_model_config(model, headers=served.auth())
        over_grpc = client.get_model_config(model, headers=served.auth(), as_json=True)["config"]
        assert over_http["name"] == over_grpc["name"] == model
        assert [(t["name"], t["data_type"]) for t in over_http["input"]] == \
            [(t["name"], t["data_type"]) for t in over_grpc["input"]]
    minilm = http.get_model_config("minilm", model_version="1", headers=served.auth())
    assert minilm["max_batch_size"] == 4096 and minilm["output"][0] == \
        {"name": "embedding", "data_type": "TYPE_FP32", "dims": [384]}
    wordy = http.get_model_config("wordy", headers=served.auth())
    assert wordy["max_batch_size"] == 0 and wordy["input"] == [{"name": "request", "data_type": "TYPE_STRING",
                                                                 "dims": [1]}]
    with pytest.raises(InferenceServerException, match="model 'nope' is not deployed"):
        http.get_model_config("nope", headers=served.auth())


def test_infer_binary_tensors_agrees_with_http(served: Served, client: tg.InferenceServerClient) -> None:
    result = client.infer("iris", [iris_input()], headers=served.auth(), request_id="r-7")
    assert list(result.as_numpy("species")) == [b"setosa", b"virginica"]
    assert result.as_numpy("probabilities").shape == (2, 3) and result.get_response().id == "r-7"
    assert result.get_response().parameters["ember_rung"].string_param   # the rung that served it
    texts = [b"The train was late.", "sm\u00f8rrebr\u00f8d".encode()]
    only = [tg.InferRequestedOutput("embedding")]
    grpc_rows = client.infer("minilm", [text_input("text", texts)], outputs=only, headers=served.auth())
    assert grpc_rows.as_numpy("token_count") is None
    http = httpx.post(served.server.url + "/v2/models/minilm/infer", headers=served.auth(), timeout=60, json={
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": [t.decode() for t in texts]}]})
    http_rows = np.array(http.json()["outputs"][0]["data"], dtype=np.float32).reshape(2, 384)
    assert np.allclose(grpc_rows.as_numpy("embedding"), http_rows, atol=1e-6)


def test_asyncio_client(served: Served) -> None:
    async def run() -> tuple[bool, np.ndarray, dict[str, Any]]:
        async with tga.InferenceServerClient(served.grpc_url) as c:
            ready = await c.is_model_ready("minilm", headers=served.auth())
            result = await c.infer("iris", [iris_input(IRIS_ROWS[:1])], headers=served.auth())
            config = await c.get_model_config("minilm", headers=served.auth(), as_json=True)
            return ready, result.as_numpy("label"), config

    ready, label, config = asyncio.run(run())
    assert ready and list(label) == [0] and config["config"]["name"] == "minilm"


def test_refusals_carry_the_grpc_code_and_name_the_field(served: Served, client: tg.InferenceServerClient) -> None:
    def refused(code: str, match: str, **kwargs: Any) -> None:
        with pytest.raises(InferenceServerException, match=match) as err:
            client.infer(**{"headers": served.auth(), **kwargs})
        assert err.value.status() == f"StatusCode.{code}"

    wrong = tg.InferInput("features", [1, 3], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
    refused("INVALID_ARGUMENT", r"input 'features': shape \[1, 3\] does not match", model_name="iris",
            inputs=[wrong])
    refused("NOT_FOUND", "model 'nope' is not deployed", model_name="nope", inputs=[iris_input()])
    refused("UNAUTHENTICATED", "missing API key", model_name="iris", inputs=[iris_input()], headers={})
    refused("UNAUTHENTICATED", "invalid API key", model_name="iris", inputs=[iris_input()],
            headers={"authorization": "Bearer not-a-key"})
    with pytest.raises(InferenceServerException, match="needs an admin key") as err:
        client.unload_model("iris", headers=served.auth(served.user))
    assert err.value.status() == "StatusCode.PERMISSION_DENIED"


def test_typed_contents_and_their_faults(served: Served) -> None:
    """tritonclient sends raw contents; another client may send typed ones."""
    with grpc.insecure_channel(served.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = tuple(served.auth().items())

        def infer(contents: dict[str, list[float]], shape: list[int]) -> Any:
            request = service_pb2.ModelInferRequest(model_name="iris")
            request.inputs.add(name="features", datatype="FP32", shape=shape, contents=contents)
            return stub.ModelInfer(request, metadata=metadata, timeout=60)

        reply = infer({"fp32_contents": IRIS_ROWS[1].tolist()}, [1, 4])
        assert [o.name for o in reply.outputs] == ["probabilities", "label", "species"]
        assert reply.raw_output_contents[2] == b"\x09\x00\x00\x00virginica"
        for contents, shape, message in ((({"int_contents": [1, 2, 3, 4]}), [1, 4], "contents.int_contents does "
                                          "not hold FP32"),
                                         ({"fp32_contents": [1.0, 2.0]}, [1, 4], "contents.fp32_contents has 2")):
            with pytest.raises(grpc.RpcError) as err:
                infer(contents, shape)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_streaming_sync_client_replies_as_they_come(served: Served, client: tg.InferenceServerClient) -> None:
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=served.auth())
    try:
        client.async_stream_infer("wordy", [chat_request("one two three")], request_id="a",
                                  enable_empty_final_response=True)
        client.async_stream_infer("nope", [chat_request("x")], request_id="b")
        replies = [got.get(timeout=60) for _ in range(5)]   # three words, the empty final one, the error
    finally:
        client.stop_stream()
    errors = [str(error) for _, error in replies if error is not None]
    assert len(errors) == 1 and "model 'nope' is not deployed" in errors[0]
    results = [result for result, error in replies if error is None]
    words = [r.as_numpy("text")[0] for r in results if r.as_numpy("text") is not None]
    assert words == [b"one ", b"two ", b"three "]
    final = [r.get_response() for r in results if r.as_numpy("text") is None]
    assert len(final) == 1 and final[0].parameters["triton_final_response"].bool_param and final[0].id == "a"


def test_streaming_asyncio_client_and_a_unary_generation_in_one_row(served: Served,
                                                                    client: tg.InferenceServerClient) -> None:
    async def run() -> list[bytes]:
        async def requests() -> Any:
            yield {"model_name": "wordy", "inputs": [chat_request("alpha beta")]}

        async with tga.InferenceServerClient(served.grpc_url) as c:
            words = []
            async for result, error in c.stream_infer(requests(), headers=served.auth()):
                assert error is None
                words.append(result.as_numpy("text")[0])
                if result.as_numpy("finish_reason")[0] == b"stop":
                    break
            return words

    assert asyncio.run(run()) == [b"alpha ", b"beta "]
    whole = client.infer("wordy", [chat_request("one two three")], headers=served.auth())
    assert list(whole.as_numpy("text")) == [b"one two three "] and list(whole.as_numpy("completion_tokens")) == [3]


def test_grpc_requests_are_counted_by_the_metrics(served: Served, client: tg.InferenceServerClient) -> None:
    client.infer("iris", [iris_input()], headers=served.auth())
    metrics = httpx.get(served.server.url + "/metrics", headers=served.auth(), timeout=10).text
    assert any(line.startswith("ember_requests_total{") and 'api="grpc"' in line and 'model="iris"' in line
               and 'code="200"' in line for line in metrics.splitlines())


def test_a_grpc_port_that_is_the_http_port_is_refused_by_name(tmp_path: Path) -> None:
    port = str(free_port())
    proc = subprocess.run([sys.executable, "-m", "ember", "serve", "--state-dir", str(tmp_path), "--port", port,
                           "--grpc-port", port], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"grpc_port: {port} is the HTTP port too" in proc.stderr
