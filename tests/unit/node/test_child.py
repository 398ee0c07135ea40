"""What a forked node process does to itself: here, pinning to a slice's cores."""

from __future__ import annotations

import os
import re

import pytest

from ember.core.slices import Slice
from ember.errors import InvalidInput
from ember.node.child import pin


def test_pinning_to_cores_outside_the_allowed_set_names_the_slice_and_the_allowed_cpus() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    outside = max(allowed) + 1000
    message = f"slice s: cores [{outside}] are not all in this process's allowed CPUs {allowed}"
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
