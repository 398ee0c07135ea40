"""The rings' one-way imports, checked in a fresh interpreter (other tests import everything)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(m for m in sys.modules if m.startswith('ember')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_contract_module_loads_no_weight_store() -> None:
    loaded = _loaded_after("ember.wire.contract")
    assert not {m for m in loaded if m.startswith("ember.store")}


@pytest.mark.parametrize("module", ["ember.serving.controller", "ember.jobs", "ember.serving.jobs"])
def test_serving_and_the_job_store_never_import_the_gateway(module: str) -> None:
    loaded = _loaded_after(module)
    assert not {m for m in loaded if m.startswith("ember.gateway")}


@pytest.mark.parametrize("module", ["ember.core.scheduler", "ember.core.autoscaler", "ember.core.batching",
                                    "ember.core.access", "ember.core.ratelimit"])
def test_the_core_imports_nothing_outside_itself(module: str) -> None:
    loaded = _loaded_after(module)
    outside = {m for m in loaded if m not in ("ember", "ember.errors") and not m.startswith("ember.core")}
    assert not outside
