"""docs/cli.md and docs/contract.md say what the code accepts: every flag and every contract key, once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ember.cli import reference

REGENERATE = "run `python -m ember.cli.reference` and commit docs/cli.md and docs/contract.md"


def _documented_flags(text: str) -> list[str]:
    """`command --flag` for every flag row of docs/cli.md, under the heading of its command."""
    found, command = [], ""
    for line in text.splitlines():
        heading = re.match(r"#+ `(ember[^`]*)`$", line)
        if heading:
            command = heading.group(1)
        found += [f"{command} {flag}" for flag in re.findall(r"`(--[\w-]+)`", line.split(" | ")[0])
                  if line.startswith("| ")]
    return found


def _documented_keys(text: str) -> list[str]:
    return re.findall(r"^\| `([\w.\[\]]+)` \|", text, flags=re.MULTILINE)


def test_the_generated_pages_are_what_the_code_says() -> None:
    stale = [path.name for path, text in reference.outputs().items() if path.read_text() != text]
    assert not stale, f"{stale} differ from the code: {REGENERATE}"


def test_every_flag_of_every_command_is_documented_once() -> None:
    documented = _documented_flags((reference.DOCS / "cli.md").read_text())
    assert sorted(documented) == sorted(set(documented)), "a flag documented twice"
    assert set(documented) == reference.cli_flags(), REGENERATE


def test_every_contract_key_is_documented_once_with_its_range() -> None:
    text = (reference.DOCS / "contract.md").read_text()
    documented = _documented_keys(text)
    assert documented == [key for key, _ in reference.contract_keys()], REGENERATE
    row = next(line for line in text.splitlines() if line.startswith("| `scaling.max_scale` |"))
    assert ">= 1, <= 1,000" in row and "most instances" in row


def test_nested_keys_are_dotted_and_lists_of_tensors_are_marked() -> None:
    keys = [key for key, _ in reference.contract_keys()]
    assert {"scaling.max_idle_s", "inputs", "inputs[].shape", "outputs[].datatype", "limits.max_tokens"} <= set(keys)
    assert "scaling" not in keys   # a section, not a key


def test_check_names_a_stale_page_and_write_mends_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "cli.md").write_text("# stale\n")
    (tmp_path / "contract.md").write_text(f"# Contract reference\n\n{reference.BEGIN}\n| old |\n{reference.END}\n")
    monkeypatch.setattr(reference, "DOCS", tmp_path)
    assert reference.main(["--check"]) == 1
    assert "cli.md differs from the code" in capsys.readouterr().err
    assert reference.main([]) == 0
    assert reference.main(["--check"]) == 0
    assert (tmp_path / "contract.md").read_text().startswith("# Contract reference\n\n")


def test_a_contract_page_without_its_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="no line"):
        reference.render_contract("# Contract reference\n")
