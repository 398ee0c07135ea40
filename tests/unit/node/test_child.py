"""What a forked node process does to itself: here, pinning to a slice's cores."""

from __future__ import annotations

import os
import re

import pytest

from ember.core.slices import Slice
from ember.errors import InvalidInput
from ember.node.child import pin


def test_pinning_to_cores_the_kernel_refuses_names_the_slice_and_the_cpus_it_runs_on() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    outside = max(allowed) + 1000
    message = f"slice s: cores [{outside}] are not all allowed here (Invalid argument; this process runs on {allowed})"
    with pytest.raises(InvalidInput, match=re.escape(message)):
        pin(Slice("s", "cpu", 64, cpus=(outside,)))
    assert sorted(os.sched_getaffinity(0)) == allowed   # nothing changed


def test_pinning_to_an_allowed_core_sets_the_affinity() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    try:
        pin(Slice("s", "cpu", 64, cpus=(core,)))
        assert os.sched_getaffinity(0) == {core}
    finally:
        os.sched_setaffinity(0, before)


def test_a_process_kept_off_a_core_may_still_pin_an_instance_to_it() -> None:
    """The node's processes keep off the slices' cores (ember.server); the instances they fork pin to them."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("one core")
    first, *rest = sorted(before)
    try:
        os.sched_setaffinity(0, set(rest))
        pin(Slice("s", "cpu", 64, cpus=(first,)))
        assert os.sched_getaffinity(0) == {first}
    finally:
        os.sched_setaffinity(0, before)
