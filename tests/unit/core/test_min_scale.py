"""A model's min scale spread over the nodes serving it (`ember.core.min_scale`), worked out by hand."""

from __future__ import annotations

from ember.core.min_scale import spread


def test_one_instance_between_three_nodes_stays_where_one_is_warm() -> None:
    serving = {n: frozenset({"m:1"}) for n in ("a", "b", "c")}
    assert spread({"m:1": 1}, serving, {}) == {"a": {"m:1": 1}, "b": {"m:1": 0}, "c": {"m:1": 0}}
    assert spread({"m:1": 1}, serving, {"c": {"m:1": 2}}) == {"c": {"m:1": 1}, "a": {"m:1": 0}, "b": {"m:1": 0}}


def test_five_over_two_nodes_is_three_and_two_and_a_lone_node_keeps_it_all() -> None:
    serving = {"a": frozenset({"m:1", "x:1"}), "b": frozenset({"m:1"})}
    assert spread({"m:1": 5, "x:1": 2}, serving, {}) == {"a": {"m:1": 3, "x:1": 2}, "b": {"m:1": 2}}


def test_models_without_a_min_scale_or_a_node_are_left_out() -> None:
    assert spread({"m:1": 0, "y:1": 2}, {"a": frozenset({"m:1"})}, {}) == {}
