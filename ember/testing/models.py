"""The bundled MiniLM as tests and benchmarks use it: its weight folder, and a store-backed contract of it."""

from __future__ import annotations

import json
from pathlib import Path

from ember.wire.contract import example_contracts_dir, load_contract


def minilm_dir() -> Path:
    """The bundled MiniLM's weight folder (the example contract's `weights`)."""
    directory = load_contract(example_contracts_dir() / "minilm.yaml").weights_path()
    assert directory is not None
    return Path(directory)


def store_backed_minilm(models: Path, name: str, file: str | None = None) -> Path:
    """A contract `name` of the bundled MiniLM with `weights: store:minilm:1` and no template (its first start
    fetches), written to `models/FILE` (default `NAME.yaml`); its path."""
    contract = load_contract(example_contracts_dir() / "minilm.yaml").model_dump(mode="json", exclude={"source"})
    contract.update(name=name, weights="store:minilm:1")
    contract["scaling"] = {**contract["scaling"], "keep_template": False}
    models.mkdir(parents=True, exist_ok=True)
    path = models / (file or f"{name}.yaml")
    path.write_text(json.dumps(contract))
    return path
