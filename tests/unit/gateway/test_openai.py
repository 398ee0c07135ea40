"""OpenAI-compatible /v1/models and /v1/embeddings: shapes, base64, errors in OpenAI's shape."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from ember.errors import Overloaded
from ember.runtimes.embedding import token_ids_element
from ember.testing.service import FakeService, fake_contracts, fake_embedding
from ember.wire.contract import example_contracts_dir, load_contract, parse_contract


def test_models_list(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["affine", "chatter", "echo", "embedder"]
    card = body["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "ember" and isinstance(card["created"], int)


def test_embeddings_float(client: TestClient) -> None:
    r = client.post("/v1/embeddings", json={"input": ["hello world", "x"], "model": "embedder", "user": "u1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "embedder"
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    assert np.allclose(body["data"][0]["embedding"], fake_embedding(b"hello world"))
    assert body["usage"] == {"prompt_tokens": 4 + 3, "total_tokens": 7}


def test_embeddings_single_string_and_base64(client: TestClient) -> None:
    r = client.post("/v1/embeddings", json={"input": "hi there", "model": "embedder:1", "encoding_format": "base64",
                                            "dimensions": 8})
    data = r.json()["data"]
    assert len(data) == 1 and r.json()["model"] == "embedder:1"
    vec = np.frombuffer(base64.b64decode(data[0]["embedding"]), dtype="<f4")
    assert np.array_equal(vec, fake_embedding(b"hi there"))


def oa_error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"input": [], "model": "embedder"}, "input", "input: must not be an empty list"),
    ({"input": ["a", ""], "model": "embedder"}, "input", "input[1]: must not be an empty string"),
    ({"input": ["a", None], "model": "embedder"}, "input", "input[1]: must be a string"),
    ({"input": {"a": 1}, "model": "embedder"}, "input", "input: must be a string, a list of strings, a list of "
                                                         "token ids or a list of token-id lists, got dict"),
    ({"input": ["a", [1]], "model": "embedder"}, "input", "input[1]: must be a string (input is a list of strings)"),
    ({"input": [[1], "a"], "model": "embedder"}, "input", "input[1]: must be a list of token ids"),
    ({"input": [[1], []], "model": "embedder"}, "input", "input[1]: must not be an empty list"),
    ({"input": [[1, 2.0]], "model": "embedder"}, "input", "input[0][1]: must be an integer token id, got float"),
    ({"input": [[1, True]], "model": "embedder"}, "input", "input[0][1]: must be an integer token id, got bool"),
    ({"input": [[1], [2, -1]], "model": "embedder"}, "input", "input[1][1]: token id -1 is not one (0 to "),
    ({"input": [5, 2**40], "model": "embedder"}, "input", "input[1]: token id 1099511627776 is not one (0 to "),
    ({"input": ["a"] * 2049, "model": "embedder"}, "input", "at most 2048"),
    ({"input": "a", "model": "embedder", "encoding_format": "hex"}, "encoding_format", "encoding_format"),
    ({"input": "a", "model": "embedder", "dimensions": 4}, "dimensions", "8-dimensional"),
    ({"input": "a", "model": "embedder", "dimensions": 0}, "dimensions", "dimensions"),
    ({"input": "a"}, "model", "model: Field required"),
    ({"input": "a", "model": "embedder", "temperature": 1}, "temperature", "temperature"),
    ({"input": "a", "model": "affine"}, "model", "'affine' is not an embedding model"),
])
def test_bad_requests_name_the_param(client: TestClient, body: dict[str, Any], param: str, needle: str) -> None:
    err = oa_error(client.post("/v1/embeddings", json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert needle in err["message"]


def test_token_ids_reach_the_model_as_its_token_id_elements(client: TestClient) -> None:
    """A list of token-id lists (or one list of ids) is embedded, each as the `text` element that carries ids
    (what the sentence-transformers runtime reads as ids: ember.runtimes.embedding)."""
    r = client.post("/v1/embeddings", json={"input": [[101, 7592, 102], [4]], "model": "embedder"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert np.allclose(data[0]["embedding"], fake_embedding(token_ids_element([101, 7592, 102])))
    assert np.allclose(data[1]["embedding"], fake_embedding(token_ids_element([4])))
    one = client.post("/v1/embeddings", json={"input": [101, 7592, 102], "model": "embedder"}).json()["data"]
    assert len(one) == 1 and one[0]["embedding"] == data[0]["embedding"]


@pytest.fixture
def minilm_service(service: FakeService) -> FakeService:
    """The fake embedder with MiniLM's model directory as its weights: the gateway reads its vocabulary (30522
    ids) and max_seq_length (256) from it."""
    minilm = load_contract(example_contracts_dir() / "minilm.yaml")
    service.models = [service.models[0].model_copy(update={"weights": minilm.weights}), *service.models[1:]]
    return service


@pytest.mark.parametrize(("body", "needle"), [
    ({"input": [[101, 102], [101, 7592, 30522]]},
     "input[1][2]: token id 30522 is not in the model's vocabulary (0 to 30521)"),
    ({"input": [101, 40000, 102]}, "input[1]: token id 40000 is not in the model's vocabulary (0 to 30521)"),
    ({"input": [[101] * 257]}, "input[0]: 257 token ids exceed the model's max_seq_length of 256"),
])
@pytest.mark.parametrize("respond_async", [False, True])
def test_token_ids_outside_the_models_vocabulary_are_a_400_naming_them(
        client: TestClient, minilm_service: FakeService, body: dict[str, Any], needle: str,
        respond_async: bool) -> None:
    headers = {"Prefer": "respond-async"} if respond_async else {}
    err = oa_error(client.post("/v1/embeddings", json={**body, "model": "embedder"}, headers=headers), 400)
    assert err["param"] == "input" and needle in err["message"]
    assert not minilm_service.calls   # refused before any instance or job
    ok = client.post("/v1/embeddings", json={"input": [[101, 30521, 102]], "model": "embedder"}, headers=headers)
    assert ok.status_code == (202 if respond_async else 200), ok.text


def test_token_ids_are_refused_by_name_for_a_model_without_a_known_vocabulary(client: TestClient,
                                                                             service: FakeService) -> None:
    python = service.models[0].model_copy(update={"name": "own", "runtime": "python", "entrypoint": "m:M"})
    service.models.append(python)
    err = oa_error(client.post("/v1/embeddings", json={"input": [1, 2], "model": "own"}), 400)
    assert err["param"] == "input" and "model 'own:1' takes text only" in err["message"] and not service.calls


def test_unknown_model_is_404_model_not_found(client: TestClient) -> None:
    err = oa_error(client.post("/v1/embeddings", json={"input": "a", "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-9" in err["message"]


def test_malformed_json_in_openai_shape(client: TestClient) -> None:
    err = oa_error(client.post("/v1/embeddings", content=b"{nope"), 400)
    assert err["message"].startswith("malformed JSON: ")


def test_overloaded_is_429_rate_limit_with_retry_after(client: TestClient, service: FakeService) -> None:
    service.failure = Overloaded("queue full", retry_after=0.2)
    r = client.post("/v1/embeddings", json={"input": "a", "model": "embedder"})
    assert oa_error(r, 429)["type"] == "rate_limit_exceeded" and r.headers["retry-after"] == "1"


def test_convention_allows_no_token_count_and_checks_it_when_present() -> None:
    from ember.gateway.openai_api import embedding_contract

    base = {"name": "e", "runtime": "sentence-transformers",
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}]}
    bare = parse_contract({**base, "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 4]}]})
    wrong = parse_contract({**base, "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 4]},
                                                {"name": "token_count", "datatype": "FP32", "shape": [-1]}]})
    service = FakeService(models=[bare, wrong.model_copy(update={"name": "w"}), *fake_contracts()])
    assert embedding_contract(service, "e") is bare
    with pytest.raises(Exception, match="'w' is not an embedding model"):
        embedding_contract(service, "w")
