"""`cpu_slots`: one per core by default; 0 only in a cluster (a gateway only), with an error naming the key; some of
them may be dedicated (`dedicated_cpu_slots`)."""

from __future__ import annotations

import pytest

from ember.config import load_serve_config
from ember.errors import InvalidInput


def test_no_slots_make_a_gateway_only_in_a_cluster_and_an_error_alone() -> None:
    assert load_serve_config(cpu_slots=0, ray="auto", allow_local_jobs=True).cpu_slots == 0
    with pytest.raises(InvalidInput, match=r"^invalid server settings: cpu_slots: 0 \(a gateway only\) needs"):
        load_serve_config(cpu_slots=0)
    with pytest.raises(InvalidInput, match="cpu_slots"):
        load_serve_config(cpu_slots=-1, ray="auto", allow_local_jobs=True)


def test_dedicated_slots_are_some_of_the_slots_and_none_by_default() -> None:
    assert load_serve_config(cpu_slots=2).dedicated_cpu_slots == 0
    assert load_serve_config(cpu_slots=2, dedicated_cpu_slots=2).dedicated_cpu_slots == 2
    with pytest.raises(InvalidInput, match=r"dedicated_cpu_slots: 3 is more than the node's cpu_slots \(2\)"):
        load_serve_config(cpu_slots=2, dedicated_cpu_slots=3)
    with pytest.raises(InvalidInput, match="dedicated_cpu_slots"):
        load_serve_config(cpu_slots=2, dedicated_cpu_slots=-1)
