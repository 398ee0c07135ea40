"""Fit the Iris softmax classifier in plain numpy and write its weights (iris.npz).

Run from anywhere: `python ember/examples/iris_softmax/train.py`. Deterministic: full-batch
gradient descent from zeros on standardised features, so rerunning reproduces iris.npz.
The data (iris.csv) is Fisher's 1936 Iris data set, 150 flowers, 3 species.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
STEPS = 2000
LEARNING_RATE = 0.5
L2 = 1e-3


def read_csv(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features (N, 4) float32, integer labels (N,), and the species names in label order."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    names = sorted({r["species"] for r in rows})
    x = np.array([[float(v) for k, v in r.items() if k != "species"] for r in rows], dtype=np.float32)
    y = np.array([names.index(r["species"]) for r in rows], dtype=np.int64)
    return x, y, np.array(names)


def fit(x: np.ndarray, y: np.ndarray, classes: int) -> dict[str, np.ndarray]:
    """Multinomial logistic regression with a small L2 penalty."""
    mean = x.mean(axis=0).astype(np.float64)
    scale = x.std(axis=0).astype(np.float64)
    z = (x - mean) / scale
    onehot = np.eye(classes)[y]
    w = np.zeros((x.shape[1], classes))
    b = np.zeros(classes)
    for _ in range(STEPS):
        logits = z @ w + b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        grad = (p - onehot) / len(x)
        w -= LEARNING_RATE * (z.T @ grad + L2 * w)
        b -= LEARNING_RATE * grad.sum(axis=0)
    return {
        "mean": mean.astype(np.float32),
        "scale": scale.astype(np.float32),
        "weight": w.astype(np.float32),
        "bias": b.astype(np.float32),
    }


def main() -> None:
    x, y, names = read_csv(HERE / "iris.csv")
    params = fit(x, y, len(names))
    np.savez(HERE / "iris.npz", allow_pickle=False, classes=names, **params)
    logits = (x - params["mean"]) / params["scale"] @ params["weight"] + params["bias"]
    print(f"training accuracy {(logits.argmax(axis=1) == y).mean():.3f}; wrote {HERE / 'iris.npz'}")


if __name__ == "__main__":
    main()
