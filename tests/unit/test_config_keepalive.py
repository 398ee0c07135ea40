"""`--keepalive`, `--keepalive-knob` and `rung_costs`: a knob out of the policy's range or a costs file that cannot be
read is refused at start, naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.config import keepalive_policy, load_serve_config, rung_costs
from ember.errors import InvalidInput
from ember.keepalive.policies import HybridHistogram, LadderCold, LadderPolicy


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


@pytest.mark.parametrize(("text", "says"), [(None, "cannot read"), ("{", r"not JSON: .* \(line 1\)"),
                                            (b"\xff\xfe", "not JSON: UnicodeDecodeError"),
                                            ("[" * 100_000, "not JSON: RecursionError")])
def test_a_rung_costs_file_that_cannot_be_had_is_refused_naming_the_setting_and_file(
        tmp_path: Path, text: str | bytes | None, says: str) -> None:
    path = tmp_path / "costs.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(InvalidInput, match=rf"^rung_costs {path}: {says}"):
        rung_costs(load_serve_config(keepalive="ladder", rung_costs=str(path)))


def test_with_snapshots_the_ladder_plans_with_a_restore_at_the_bottom() -> None:
    from ember.core.rung_costs import RESTORE_START_S, RungCosts

    assert rung_costs(load_serve_config()).cold == RungCosts().cold
    assert rung_costs(load_serve_config(snapshots=True)).cold.start_s == RESTORE_START_S


def test_a_restore_time_out_of_range_is_refused_naming_the_flag() -> None:
    from ember.cli.sim import _costs

    with pytest.raises(InvalidInput, match="--restore-s: -1 is not a restore time in seconds"):
        _costs(None, -1.0)
