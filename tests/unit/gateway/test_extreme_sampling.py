"""Odd but valid sampling values (the fuzz's 5xx findings): every one in range is served or refused with a 400,
through the gateway's parsing and through the llm runtime's sampler itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
from starlette.testclient import TestClient

from ember.runtimes.llm_sampling import Sampler

EXTREME = [
    {"temperature": 1e-38}, {"temperature": 5e-324}, {"temperature": 0}, {"temperature": 2},
    {"top_p": 1e-300}, {"top_p": 5e-324}, {"top_p": 1}, {"temperature": 1e-38, "top_p": 1e-300},
    {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"seed": 2**64}, {"max_tokens": 1}, {"max_tokens": 2**31},
    {"temperature": 1e308}, {"top_p": 1.0000000000000002}, {"temperature": -0.0}, {"top_p": 0},
    {"logit_bias": {"0": 100}}, {"logit_bias": {"0": -100}}, {"logit_bias": {"99999999999": 1}},
    {"presence_penalty": 2}, {"frequency_penalty": -2}, {"n": 1}, {"stop": [""]},
]


@pytest.mark.parametrize("extra", EXTREME, ids=[str(e) for e in EXTREME])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v2/models/chatter/generate"])
def test_extreme_in_range_sampling_values_are_served_or_refused_with_a_400(
        client: TestClient, route: str, extra: dict[str, object]) -> None:
    if route == "/v1/chat/completions":
        body: dict[str, object] = {"model": "chatter", "messages": [{"role": "user", "content": "hi"}], **extra}
    elif route == "/v1/completions":
        body = {"model": "chatter", "prompt": "hi", **extra}
    else:
        body = {"text_input": "hi", "parameters": extra}
    r = client.post(route, json=body)
    assert r.status_code in (200, 400), (r.status_code, r.text)


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324, 1e-6, 1.0, 2.0])
@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-38, 0.5, 1.0])
def test_the_sampler_picks_a_real_token_for_any_value_in_range(temperature: float, top_p: float) -> None:
    logits = np.random.default_rng(0).normal(size=5000).astype(np.float32) * 10
    logits[[3, 7]] = -np.inf                                   # what a grammar masks
    for logprobs in (False, True):
        with np.errstate(all="ignore"):
            choice = Sampler(temperature, top_p, seed=1, logprobs=logprobs, top_logprobs=3 if logprobs else 0) \
                .pick(logits)
        assert 0 <= choice.token < len(logits) and choice.token not in (3, 7)
        if logprobs:
            assert choice.logprob is not None and math.isfinite(choice.logprob)


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324, 1e-320])
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    logits = np.random.default_rng(0).normal(size=5000).astype(np.float32) * 10
    with np.errstate(all="ignore"):
        assert Sampler(temperature, 1.0, seed=1).pick(logits).token == int(np.argmax(logits))
