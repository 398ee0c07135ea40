"""The served class of the Iris example (`entrypoint: "iris_softmax.model:IrisClassifier"`).

Input `features` FP32 [-1, 4]: sepal length, sepal width, petal length, petal width in cm.
Outputs `probabilities` FP32 [-1, 3] (classes in `species` order), `label` INT64 [-1] and
`species` BYTES [-1] (e.g. b"setosa"). Weights: iris.npz written by train.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ember.errors import InvalidInput

_ARRAYS = ("mean", "scale", "weight", "bias", "classes")


class IrisClassifier:
    """Standardise, one linear layer, softmax."""

    def __init__(self) -> None:
        self.params: dict[str, np.ndarray] = {}

    def load(self, weights: Path | None, options: dict[str, Any]) -> None:
        if weights is None:
            raise ValueError("the Iris classifier needs weights: iris.npz")
        # allow_pickle=False: a weights file must never run code.
        with np.load(weights, allow_pickle=False) as npz:
            missing = [k for k in _ARRAYS if k not in npz.files]
            if missing:
                raise ValueError(f"{weights.name} lacks arrays {missing}")
            self.params = {k: npz[k] for k in _ARRAYS}
        self.species = np.array([s.encode() for s in self.params["classes"]], dtype=object)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["features"]
        if not np.isfinite(x).all():
            raise InvalidInput("input 'features': values must be finite numbers (cm)")
        p = self.params
        logits = ((x - p["mean"]) / p["scale"]) @ p["weight"] + p["bias"]
        logits = logits - logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        label = probs.argmax(axis=1).astype(np.int64)
        return {"probabilities": probs.astype(np.float32), "label": label, "species": self.species[label]}
