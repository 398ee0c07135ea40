"""`--keepalive` and `--keepalive-knob`: a knob out of the policy's range is refused at start, naming the flag."""

from __future__ import annotations

import pytest

from ember.config import keepalive_policy, load_serve_config
from ember.core.keepalive import HybridHistogram, LadderCold, LadderPolicy
from ember.errors import InvalidInput


def test_the_knob_reaches_the_policy() -> None:
    policy = keepalive_policy(load_serve_config(keepalive="hybrid", keepalive_knob=1800.0))
    assert isinstance(policy, HybridHistogram) and policy.range_s == 1800.0
    assert isinstance(keepalive_policy(load_serve_config(keepalive="ladder")), LadderPolicy)
    assert keepalive_policy(load_serve_config()) is None
    cold = keepalive_policy(load_serve_config(keepalive="ladder-cold", keepalive_knob=5e5))
    assert isinstance(cold, LadderCold) and cold.cold_value == 5e5 and cold.latency_value == 0.0


def test_a_cold_value_out_of_range_is_refused_naming_the_flag_and_the_constant() -> None:
    with pytest.raises(InvalidInput, match=r"^keepalive_knob: ladder-cold: cold_value must lie in \[0, 1e\+15\]"):
        keepalive_policy(load_serve_config(keepalive="ladder-cold", keepalive_knob=1e16))


@pytest.mark.parametrize("policy", ["hybrid", "hybrid-zygote"])
def test_a_knob_the_policy_cannot_take_is_refused_naming_the_flag(policy: str) -> None:
    config = load_serve_config(keepalive=policy, keepalive_knob=0.0)
    message = rf"^keepalive_knob: {policy}: range_s must lie in \[60, 5.184e\+06\], got 0.0"
    with pytest.raises(InvalidInput, match=message):
        keepalive_policy(config)


def test_a_negative_knob_is_refused_by_the_settings() -> None:
    with pytest.raises(InvalidInput, match="keepalive_knob"):
        load_serve_config(keepalive="fixed", keepalive_knob=-1.0)
