"""The repository: contract files, parsed or not, and no two of one name:version."""

from __future__ import annotations

from pathlib import Path

from ember.serving.repository import Repository
from ember.testing.controller import contract_text


def test_a_second_file_with_the_same_name_and_version_is_refused_naming_both(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(contract_text("m"))
    (tmp_path / "b.yaml").write_text(contract_text("m"))
    (tmp_path / "c.yaml").write_text(contract_text("other"))
    entries = Repository([tmp_path]).scan()
    good = [e for e in entries if e.contract is not None]
    assert [e.path.name for e in good] == ["a.yaml", "c.yaml"]
    bad = next(e for e in entries if e.contract is None)
    assert bad.name == "b" and bad.error is not None
    assert "b.yaml" in bad.error and "a.yaml" in bad.error and "'m:1'" in bad.error
