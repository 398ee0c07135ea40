"""The ladder's preset: one policy object for `ember serve` and `ember sim`, and its file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.config import keepalive_policy, load_preset, load_serve_config
from ember.core.rung_costs import RungCosts
from ember.errors import InvalidInput
from ember.keepalive.policies import LadderCold, LadderPolicy
from ember.keepalive.preset import AZURE_2019_DEV, DEFAULT_PRESET, document, from_document, named
from ember.sim.runner import build_policies


def test_serve_runs_the_default_preset_and_sim_builds_the_same_object() -> None:
    served = keepalive_policy(load_serve_config(keepalive="ladder"))
    preset = named(DEFAULT_PRESET)
    assert served == preset.ladder(costs=RungCosts())
    assert isinstance(served, LadderPolicy)
    for name, value in AZURE_2019_DEV.items():
        assert getattr(served, name) == value
    simulated = build_policies(["ladder"], {}, RungCosts(), 1.0, load_preset(None))[0]
    assert simulated == served
    cold = keepalive_policy(load_serve_config(keepalive="ladder-cold", keepalive_knob=1e6))
    assert isinstance(cold, LadderCold) and cold.cold_value == 1e6 and cold.climb_lead == AZURE_2019_DEV["climb_lead"]


def test_a_preset_file_round_trips_and_reaches_serve_and_sim(tmp_path: Path) -> None:
    path = tmp_path / "preset.json"
    path.write_text(json.dumps({"name": "mine", "constants": {"head_splits": 6, "smooth_weight": 2}}))
    served = keepalive_policy(load_serve_config(keepalive="ladder", keepalive_preset=path, keepalive_knob=1e6))
    assert isinstance(served, LadderPolicy)
    assert served.head_splits == 6 and served.smooth_weight == 2.0 and served.latency_value == 1e6
    assert served.climb_lead == LadderPolicy().climb_lead            # a file's preset is whole: no default mixed in
    assert build_policies(["ladder"], {"ladder": {"latency_value": 1e6}}, RungCosts(), 1.0,
                          load_preset(path))[0] == served
    assert from_document(document(named())) == named()


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "expected {\"name\""),
        ({"constants": {"latency_value": 5}}, "latency_value is the objective's knob"),
        ({"constants": {"warp": 1}}, "'warp' is not a knob"),
        ({"constants": {"head_splits": "many"}}, "constants.head_splits: expected a number"),
        ({"constants": {"head_splits": 1.5}}, "head_splits must be a whole number"),
        ({"constants": {"smooth_weight": -1}}, "smooth_weight"),
        ({"name": "", "constants": {}}, "name: expected a non-empty string"),
    ],
)
def test_a_bad_preset_is_refused_naming_what(doc: object, message: str) -> None:
    with pytest.raises(InvalidInput, match="^p: .*" if message.startswith("expected") else None) as err:
        from_document(doc, "p")
    assert message in err.value.message


def test_a_bad_preset_file_is_refused_at_start_naming_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(InvalidInput, match="--keepalive-preset"):
        keepalive_policy(load_serve_config(keepalive="ladder", keepalive_preset=path))
    with pytest.raises(InvalidInput, match="unknown keep-alive preset 'nope'"):
        named("nope")
