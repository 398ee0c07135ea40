"""`jobs_url`: SQLite by default, a postgresql:// URL (flag or $EMBER_JOBS_URL) selects the shared store; its
password is never echoed, in errors or in the settings' repr."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.config import load_serve_config
from ember.errors import InvalidInput
from ember.jobs.store import JobStore
from ember.server import job_store


def test_sqlite_is_the_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EMBER_JOBS_URL", raising=False)
    config = load_serve_config(state_dir=tmp_path)
    assert config.jobs_url is None
    with job_store(config, tmp_path) as jobs:
        assert isinstance(jobs, JobStore) and jobs.path == tmp_path / "jobs.sqlite3"


def test_the_url_comes_from_the_flag_or_the_environment_and_its_password_stays_hidden(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_JOBS_URL", "postgresql://ember:s3cret@db:5432/jobs")
    config = load_serve_config()
    assert config.jobs_url is not None and config.jobs_url.get_secret_value().endswith("@db:5432/jobs")
    assert "s3cret" not in repr(config)
    flag = load_serve_config(jobs_url="postgres://other@db/jobs")
    assert flag.jobs_url is not None and flag.jobs_url.get_secret_value() == "postgres://other@db/jobs"


def test_a_url_that_is_not_postgresql_names_the_key_and_not_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBER_JOBS_URL", raising=False)
    with pytest.raises(InvalidInput, match=r"jobs_url: .*must be a postgresql:// URL") as err:
        load_serve_config(jobs_url="mysql://root:s3cret@db/jobs")
    assert "s3cret" not in err.value.message
