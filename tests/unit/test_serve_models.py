"""`ember serve --models`: one's own models beside the bundled examples (`--no-examples`: alone); the port from
$EMBER_PORT."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.cli import build_parser
from ember.config import load_serve_config
from ember.errors import InvalidInput
from ember.server import repository
from ember.testing.controller import contract_text
from ember.testing.server import EmberServer
from ember.wire.contract import example_contracts_dir

EXAMPLES = {"iris", "minilm", "smollm2"}


def served(entries: list) -> set[str]:
    return {e.name for e in entries if e.contract is not None}


def test_models_are_served_beside_the_examples(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text(contract_text("mine"))
    entries = repository(load_serve_config(models=(tmp_path,))).scan()
    assert served(entries) == EXAMPLES | {"mine"}
    assert all(e.error is None for e in entries)


def test_no_examples_serves_only_ones_own(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text(contract_text("mine"))
    assert served(repository(load_serve_config(models=(tmp_path,), examples=False)).scan()) == {"mine"}
    assert served(repository(load_serve_config()).scan()) == EXAMPLES


def test_an_edited_copy_of_an_example_replaces_it_without_a_clash(tmp_path: Path) -> None:
    text = (example_contracts_dir() / "iris.yaml").read_text()
    (tmp_path / "iris.yaml").write_text(text + "\n# my copy\n")
    entries = repository(load_serve_config(models=(tmp_path / "iris.yaml",))).scan()
    iris = [e for e in entries if e.name == "iris"]
    assert [e.path for e in iris] == [tmp_path / "iris.yaml"] and iris[0].error is None


def test_the_test_server_leaves_the_examples_out_when_given_models(tmp_path: Path) -> None:
    off = ("--grpc-port", "0")   # test servers run side by side: no gRPC port unless a test asks for one
    assert EmberServer(tmp_path, "--models", "x.yaml").args == ("--models", "x.yaml", "--no-examples", *off)
    assert EmberServer(tmp_path, "--models", "x.yaml", examples=True).args == ("--models", "x.yaml", *off)
    assert EmberServer(tmp_path, "--cpu-slots", "1").args == ("--cpu-slots", "1", *off)
    assert EmberServer(tmp_path, "--grpc-port", "8123").args == ("--grpc-port", "8123")


def test_the_port_defaults_to_ember_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBER_PORT", raising=False)
    assert load_serve_config().port == 8000
    monkeypatch.setenv("EMBER_PORT", "8123")
    assert load_serve_config().port == 8123
    assert load_serve_config(port=9000).port == 9000
    monkeypatch.setenv("EMBER_PORT", "eighty")
    with pytest.raises(InvalidInput, match="port: .*'eighty'"):
        load_serve_config()


def test_status_asks_on_ember_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_PORT", "8123")
    assert build_parser().parse_args(["status"]).url == "http://127.0.0.1:8123"
    monkeypatch.delenv("EMBER_PORT")
    assert build_parser().parse_args(["status"]).url == "http://127.0.0.1:8000"
