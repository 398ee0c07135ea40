"""The repository: contract files, parsed or not, and no two of one name:version."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ember.serving import repository
from ember.serving.repository import Repository
from ember.testing.controller import contract_text
from ember.wire.contract import ModelContract, load_contract


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


def counting_loads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The paths the repository parses, in order."""
    parsed: list[Path] = []

    def load(path: Path) -> ModelContract:
        parsed.append(path)
        return load_contract(path)

    monkeypatch.setattr(repository, "load_contract", load)
    return parsed


def test_an_unchanged_file_is_not_parsed_again_and_a_changed_one_is(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = counting_loads(monkeypatch)
    (tmp_path / "a.yaml").write_text(contract_text("a"))
    (tmp_path / "b.yaml").write_text(contract_text("b"))
    repo = Repository([tmp_path])
    assert [e.name for e in repo.scan()] == ["a", "b"]
    assert [e.name for e in repo.scan()] == ["a", "b"]
    assert [p.name for p in parsed] == ["a.yaml", "b.yaml"]      # the second scan parsed nothing
    (tmp_path / "b.yaml").write_text(contract_text("b", max_scale=3))    # another size
    st = (tmp_path / "a.yaml").stat()
    os.utime(tmp_path / "a.yaml", ns=(st.st_atime_ns, st.st_mtime_ns + 1))   # same size, another mtime
    entries = repo.scan()
    assert [p.name for p in parsed[2:]] == ["a.yaml", "b.yaml"]
    b = next(e for e in entries if e.name == "b")
    assert b.contract is not None and b.contract.scaling.max_scale == 3


def test_a_bad_file_keeps_its_error_until_it_is_fixed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = counting_loads(monkeypatch)
    (tmp_path / "a.yaml").write_text("name: a\nruntime: python\n")
    repo = Repository([tmp_path])
    first, again = repo.scan(), repo.scan()
    assert first == again and first[0].error is not None and "inputs: Field required" in first[0].error
    assert len(parsed) == 1
    (tmp_path / "a.yaml").write_text(contract_text("a"))
    assert repo.scan()[0].contract is not None and len(parsed) == 2
