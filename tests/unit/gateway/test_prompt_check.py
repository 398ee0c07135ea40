"""What an instance would refuse at once is refused by the gateway before a job is accepted: an async request
(`Prefer: respond-async`) gets the 400 its synchronous twin gets, not a 202 and a failed job later. The `llm`
runtime's checks, which need the GGUF's vocabulary, are in tests/integration/gateway/test_prompt_check.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from starlette.testclient import TestClient

from ember.testing.service import FakeService
from ember.wire.tensors import to_raw

HEADER = "Inference-Header-Content-Length"


def _binary_texts(*texts: bytes) -> tuple[bytes, dict[str, str]]:
    raw = to_raw(np.array(list(texts), dtype=object))
    head = json.dumps({"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return head + raw, {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}


@pytest.mark.parametrize("prefer", ["respond-async", None])
def test_an_encoders_text_that_is_not_utf8_is_a_400_before_any_job(client: TestClient, service: FakeService,
                                                                    prefer: str | None) -> None:
    body, headers = _binary_texts(b"fine", b"caf\xe9")   # Latin-1, not UTF-8: the encoder's instance refuses it
    if prefer:
        headers["Prefer"] = prefer
    r = client.post("/v2/models/embedder/infer", content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("input 'text': element 1 is not valid UTF-8")
    assert service.calls == []   # no job queued, no instance asked


def test_an_encoders_utf8_texts_are_accepted_as_a_job(client: TestClient, service: FakeService) -> None:
    body, headers = _binary_texts(b"fine", "caf\u00e9".encode())
    r = client.post("/v2/models/embedder/infer", content=body, headers={**headers, "Prefer": "respond-async"})
    assert r.status_code == 202, r.text


def test_concurrent_first_requests_build_one_checker_and_a_redeploy_replaces_it(monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    import threading
    import time

    from ember.gateway import prompt_check
    from ember.wire.contract import example_contracts_dir, load_contract

    builds: list[str] = []

    def slow_build(contract: object) -> object:
        builds.append(str(contract))
        time.sleep(0.05)   # long enough for the other threads to arrive while it builds
        return lambda raw: None

    monkeypatch.setattr(prompt_check, "_build", slow_build)
    monkeypatch.setattr(prompt_check, "_checks", {})
    contract = load_contract(example_contracts_dir() / "smollm2.yaml")
    threads = [threading.Thread(target=prompt_check.checker, args=(contract,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    redeployed = contract.model_copy(update={"options": {**contract.options, "kv_type": "q8_0"}})
    prompt_check.checker(redeployed)
    assert len(builds) == 2 and list(prompt_check._checks) == [prompt_check._deployed(redeployed)]


def _request_body(request: dict[str, object]) -> dict[str, object]:
    return {"inputs": [{"name": "request", "shape": [1], "datatype": "BYTES", "data": [json.dumps(request)]}]}


@pytest.mark.parametrize(("request_", "message"), [
    ({"prompt": "a b", "temperature": 3}, "temperature: must be a number from 0 to 2"),
    ({"prompt": "a b", "tool_choice": "required"}, "tool_choice: 'required' needs tools"),
    ({"prompt": "a b", "max_tokens": 9}, "max_tokens: 9 exceeds the limit of 8 (the contract's limits.max_tokens)"),
])
def test_a_generation_request_to_queue_is_held_to_the_requests_rules_before_the_202(request_: dict[str, object],
                                                                                    message: str) -> None:
    """A vllm (or llm) model with no vocabulary to check against here: the request's own rules
    (`ember.wire.generation`), the ones its instance applies, refuse it before it waits as a job."""
    from ember.gateway.app import create_app
    from ember.metrics import Metrics
    from ember.testing.service import fake_contracts

    models = [c.model_copy(update={"runtime": "vllm", "limits": c.limits.model_copy(update={"max_tokens": 8})})
              if c.name == "chatter" else c for c in fake_contracts()]
    service = FakeService(models=models)
    with TestClient(create_app(service, Metrics())) as client:
        r = client.post("/v2/models/chatter/infer", json=_request_body(request_),
                        headers={"Prefer": "respond-async"})
        assert r.status_code == 400 and r.json()["error"] == message, r.text
        assert service.calls == []
        ok = client.post("/v2/models/chatter/infer", json=_request_body({"prompt": "a b", "max_tokens": 8}))
        assert ok.status_code == 200, ok.text
