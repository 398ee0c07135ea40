"""A cluster's settings: `--ray` needs a shared job store (or `--allow-local-jobs`); `--tls-dir` a node directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.cluster.ca import init_ca, issue
from ember.config import load_serve_config
from ember.errors import InvalidInput


def test_ray_without_a_shared_job_store_is_refused_naming_jobs_url_unless_local_jobs_are_allowed() -> None:
    with pytest.raises(InvalidInput, match="ray: a cluster needs a shared job store: .*--jobs-url.*--allow-local-jobs"):
        load_serve_config(ray="auto")
    assert load_serve_config(ray="auto", allow_local_jobs=True).ray == "auto"
    assert load_serve_config(ray="auto", jobs_url="postgresql://ember@db/ember").jobs_url is not None
    assert load_serve_config().ray is None   # one node: its own queue, as ever


def test_tls_dir_must_be_a_node_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidInput, match="tls_dir: .* lacks ca.crt, tls.crt, tls.key"):
        load_serve_config(tls_dir=tmp_path)
    init_ca(tmp_path)
    node = issue(tmp_path, "a")
    assert load_serve_config(tls_dir=node).tls_dir == node
    monkeypatch.setenv("EMBER_TLS_DIR", str(node))
    assert load_serve_config().tls_dir == node
