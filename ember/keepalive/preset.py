"""The ladder's tuned constants as a named preset: one policy object for `ember serve` and `ember sim`.

`ember serve --keepalive ladder` (and `ladder-cold`) builds its policy from the default preset, and `ember sim`
(its sweeps and `--verdict`) builds the very same one; `--keepalive-preset FILE` gives either another preset, a JSON
document `{"name": ..., "constants": {NAME: number, ...}}` (what a tuning run writes, `document`). The constants are
the ladder's (`LadderPolicy`'s numeric fields) but its objective's knobs (`latency_value`, `cold_value`), which the
operator sets (`--keepalive-knob`) and the simulator sweeps. Pure: the edges read and write the files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ember.core.rung_costs import RungCosts
from ember.errors import InvalidInput
from ember.keepalive.idle_plan import numeric_knobs, typed_knobs
from ember.keepalive.policies import LadderCold, LadderPolicy

# Knobs a preset does not hold: the objective (set by the operator, swept by the simulator), and what the driver
# knows (the zygote's sharing).
OBJECTIVE = frozenset({"latency_value", "cold_value", "cold_per_app", "zygote_share"})

# Tuned on the two development days of the Azure Functions 2019 trace (dev-a, dev-b) with `ember sim --verdict`
# (docs/policies.md, "The verdict"): the head at its finest with the climbs' lead times, pseudo-arrivals, the
# zygote's rent where the statistics are blind, and the pooled prior.
AZURE_2019_DEV: dict[str, float] = {
    "head_splits": 12, "bin_s": 60.0, "prior_min_s": 0.01, "prior_max_s": 86400.0, "prior_weight": 1.0,
    "smooth_weight": 0.0, "pooled_weight": 1.0, "smooth_events": 1.0, "decide_splits": 0, "rent_floor": 1.0,
    "climb_lead": 1.0,
}
PRESETS: dict[str, dict[str, float]] = {"azure-2019-dev": AZURE_2019_DEV, "class-defaults": {}}
DEFAULT_PRESET = "azure-2019-dev"


@dataclass(frozen=True)
class Preset:
    """A named set of the ladder's constants."""

    name: str
    constants: Mapping[str, Any] = field(default_factory=dict)

    def ladder(self, *, cold: bool = False, costs: RungCosts | None = None, **knobs: Any) -> LadderPolicy:
        """The ladder (its ATC objective with `cold`) with these constants; `knobs` (its objective's, its costs',
        its zygote share) on top."""
        cls = LadderCold if cold else LadderPolicy
        extra = {"costs": costs} if costs is not None else {}
        return cls(**{**self.constants, **extra, **knobs})


def named(name: str = DEFAULT_PRESET) -> Preset:
    if name not in PRESETS:
        raise InvalidInput(f"unknown keep-alive preset {name!r} (known: {', '.join(PRESETS)})")
    return Preset(name, dict(PRESETS[name]))


def from_document(doc: Any, where: str = "preset") -> Preset:
    """A preset from its JSON document; InvalidInput names what is wrong (a knob not a ladder constant, a value out
    of its range)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("constants"), dict):
        raise InvalidInput(f"{where}: expected {{\"name\": ..., \"constants\": {{NAME: number, ...}}}}")
    name = doc.get("name", "file")
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"{where}: name: expected a non-empty string")
    raw = doc["constants"]
    for k, v in raw.items():
        if k in OBJECTIVE:
            raise InvalidInput(f"{where}: {k} is the objective's knob, not a preset constant "
                               "(set it with --keepalive-knob; the simulator sweeps it)")
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise InvalidInput(f"{where}: constants.{k}: expected a number, got {v!r}")
    constants = typed_knobs(f"{where}: ladder", LadderPolicy, raw)
    preset = Preset(name, constants)
    preset.ladder()                         # every value in its range, checked here
    return preset


def document(preset: Preset) -> dict[str, Any]:
    """The JSON document `from_document` reads back."""
    known = numeric_knobs(LadderPolicy)
    return {"name": preset.name, "constants": {k: preset.constants[k] for k in sorted(preset.constants) if k in known}}


__all__ = ["DEFAULT_PRESET", "PRESETS", "Preset", "document", "from_document", "named"]
