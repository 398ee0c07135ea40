"""The server's weight store settings: defaults from the environment like `ember store`, errors name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.config import load_serve_config
from ember.errors import InvalidInput


def test_store_settings_default_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBER_STORE", str(tmp_path / "env-root"))
    monkeypatch.setenv("EMBER_STORE_ORIGIN", "http://origin.example:8080/store")
    config = load_serve_config()
    assert config.store_root == tmp_path / "env-root"
    store = config.store_config()
    assert store.root == tmp_path / "env-root" and store.origin == "http://origin.example:8080/store/"


def test_flags_win_and_no_origin_is_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBER_STORE", str(tmp_path / "env-root"))
    monkeypatch.delenv("EMBER_STORE_ORIGIN", raising=False)
    config = load_serve_config(store_root=tmp_path / "flag-root", store_origin=None)
    assert config.store_root == tmp_path / "flag-root" and config.store_origin is None
    assert config.store_config().origin is None


def test_a_bad_origin_names_the_key() -> None:
    with pytest.raises(InvalidInput, match="store_origin: .*http:// or https://.*ftp://x"):
        load_serve_config(store_origin="ftp://x")


def test_idle_polling_defaults_on_and_a_bad_value_names_the_key_and_range() -> None:
    assert load_serve_config().idle_poll_us == 2000
    assert load_serve_config(idle_poll_us=0).idle_poll_us == 0
    with pytest.raises(InvalidInput, match="idle_poll_us: .*less than or equal to 100000"):
        load_serve_config(idle_poll_us=500_000)
