"""The scale-up decision (`ember/core/scale_up.py`): when to ask for machines, and for how many."""

from __future__ import annotations

from ember.core.scale_up import ScaleUp, decide, found_no_room, placed


def test_nothing_waiting_asks_for_nothing() -> None:
    assert decide({}, 0.0, hold_s=60, max_nodes=10) == ScaleUp(0, ())


def test_one_more_node_per_model_waiting_for_room_over_the_nodes_there_were() -> None:
    waiting = found_no_room({}, "a:1", 0.0, live=3)
    assert decide(waiting, 1.0, hold_s=60, max_nodes=10) == ScaleUp(4, ("a:1",))
    waiting = found_no_room(waiting, "b:1", 2.0, live=3)
    assert decide(waiting, 2.0, hold_s=60, max_nodes=10) == ScaleUp(5, ("a:1", "b:1"))
    assert decide(waiting, 2.0, hold_s=60, max_nodes=4).nodes == 4          # never past max_nodes


def test_the_node_asked_for_joining_does_not_ask_for_another_until_the_model_finds_no_room_again() -> None:
    waiting = found_no_room({}, "a:1", 0.0, live=3)
    waiting = found_no_room(waiting, "a:1", 5.0, live=3)                    # again, before the node came
    assert decide(waiting, 5.0, hold_s=60, max_nodes=10).nodes == 4
    # The fourth node joined; the request is unchanged (its size counts every node, busy or not).
    assert decide(waiting, 30.0, hold_s=60, max_nodes=10).nodes == 4
    waiting = found_no_room(waiting, "a:1", 31.0, live=4)                   # the new node too is full: one more
    assert decide(waiting, 31.0, hold_s=60, max_nodes=10).nodes == 5


def test_a_model_placed_or_not_seen_waiting_for_hold_s_stops_waiting_and_the_request_is_withdrawn() -> None:
    waiting = found_no_room(found_no_room({}, "a:1", 0.0, live=2), "b:1", 10.0, live=2)
    assert decide(placed(waiting, "b:1"), 10.0, hold_s=60, max_nodes=10) == ScaleUp(3, ("a:1",))
    assert decide(waiting, 60.0, hold_s=60, max_nodes=10) == ScaleUp(4, ("a:1", "b:1"))
    assert decide(waiting, 60.5, hold_s=60, max_nodes=10) == ScaleUp(3, ("b:1",))
    assert decide(waiting, 70.5, hold_s=60, max_nodes=10) == ScaleUp(0, ())
