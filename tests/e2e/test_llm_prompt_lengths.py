"""Every prompt up to the context is served, and one over it refused with a 400, through a real `ember serve`:
16 clients at once send prompts of 1 to 9,000 tokens to a random-weight Llama whose context is 8,192, and the
instance is never killed (its pid stays) nor any stream lost. A tiny model (2 layers, width 64) keeps a prompt's
prefill cheap; the scheduling, admission and memory accounting are those of any model."""

from __future__ import annotations

import concurrent.futures
import json
import random

import httpx
import pytest

from ember.testing.gguf_models import TINY, Shape, write_model
from ember.testing.server import EmberServer
from ember.wire.contract import example_contracts_dir, load_contract

pytestmark = pytest.mark.slow

CONTEXT = 8192


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> EmberServer:
    tmp = tmp_path_factory.mktemp("lengths")
    gguf = write_model(tmp / "tiny.gguf", "llama", Shape(**{**TINY.__dict__, "context": CONTEXT}))
    data = load_contract(example_contracts_dir() / "smollm2.yaml").model_dump(mode="json", exclude={"source"})
    data.update(name="tiny", weights=str(gguf), warmup={"requests": 0})
    data["scaling"] = {**data["scaling"], "min_scale": 1, "max_scale": 1, "pause_after_s": 3600, "max_idle_s": 3600}
    data["options"] = {"kv_tokens": CONTEXT, "default_max_tokens": 4}
    models = tmp / "models"
    models.mkdir()
    (models / "tiny.yaml").write_text(json.dumps(data))
    data.update(name="tiny-idle")   # scaled to zero: nothing runs until a request a rung must serve
    data["scaling"] = {**data["scaling"], "min_scale": 0}
    (models / "tiny-idle.yaml").write_text(json.dumps(data))
    with EmberServer(tmp / "state", "--models", str(models), "--no-examples", "--log-level", "warning",
                     "--request-timeout-s", "300") as s:
        yield s


def complete(client: httpx.Client, tokens: int) -> tuple[int, int, str]:
    """(status, prompt tokens reported, message) for a prompt of about `tokens` tokens (" a" is one token)."""
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": " a" * tokens, "max_tokens": 2,
                                             "temperature": 0})
    body = r.json()
    if r.status_code == 200:
        return 200, body["usage"]["prompt_tokens"], ""
    return r.status_code, 0, body.get("error", {}).get("message", "")


def test_prompts_of_every_length_are_served_or_refused_and_the_instance_lives(server: EmberServer) -> None:
    lengths = [1, 2, 100, 1000, 4000, 8000, CONTEXT - 3, CONTEXT - 1, CONTEXT, 9000]
    lengths += random.Random(7).sample(range(1, 9001), 22)
    with httpx.Client(base_url=server.url, timeout=300) as client:
        complete(client, 4)
        pids = {i["pid"] for i in server.instances("tiny")}
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = dict(zip(lengths, pool.map(lambda n: complete(client, n), lengths), strict=True))
        after = {i["pid"] for i in server.instances("tiny")}
    for n, (status, prompt_tokens, message) in results.items():
        if n + 2 <= CONTEXT - 1:   # room for the prompt and its 2 tokens
            assert status == 200 and prompt_tokens == n, (n, status, message)
        elif n >= CONTEXT:
            assert status == 400 and "context" in message, (n, status, message)
        else:
            assert status in (200, 400), (n, status, message)
    assert after == pids, "the instance was replaced: it died"


def test_a_prompt_over_the_context_is_refused_before_any_rung_is_claimed(server: EmberServer) -> None:
    """The gateway runs the instance's own prompt checks (the GGUF's vocabulary only): a model scaled to zero
    answers 400 for a prompt that cannot fit, and no instance is started for it."""
    with httpx.Client(base_url=server.url, timeout=300) as client:
        for body in ({"model": "tiny-idle", "prompt": " a" * 9000, "max_tokens": 2},
                     {"model": "tiny-idle", "messages": [{"role": "user", "content": " a" * 9000}]},
                     {"model": "tiny-idle", "prompt": " a" * 8000, "max_tokens": 500}):
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = client.post(route, json=body)
            assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
        r = client.post("/v2/models/tiny-idle/generate", json={"text_input": " a" * 9000})
        assert r.status_code == 400 and "context" in r.text
        assert server.instances("tiny-idle") == []
        ok = client.post("/v1/completions", json={"model": "tiny-idle", "prompt": " a" * 100, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 100
