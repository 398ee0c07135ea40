"""The model repository: the contract files ember was pointed at, parsed or not.

A bad contract is listed as UNAVAILABLE with the validation message; it never stops
the good ones from being served.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ember.errors import ContractInvalid, ModelNotFound
from ember.wire.contract import ModelContract, find_contracts, load_contract


@dataclass(frozen=True)
class Entry:
    path: Path
    contract: ModelContract | None
    error: str | None

    @property
    def name(self) -> str:
        return self.contract.name if self.contract is not None else self.path.stem


class Repository:
    def __init__(self, sources: list[Path]) -> None:
        self._sources = list(sources)

    def scan(self) -> list[Entry]:
        """Re-read every contract file (so edits are picked up by a repository load). A second file with a
        `name:version` an earlier one has is refused, naming both files: which one served would be luck."""
        entries: list[Entry] = []
        seen: dict[str, Path] = {}
        for source in self._sources:
            for path in find_contracts(source):
                try:
                    contract = load_contract(path)
                except ContractInvalid as err:
                    entries.append(Entry(path, None, err.message))
                    continue
                first = seen.setdefault(contract.key, path)
                if first != path:
                    entries.append(Entry(path, None, f"{path}: model '{contract.key}' is already defined by {first}"))
                    continue
                entries.append(Entry(path, contract, None))
        return entries

    def find(self, name: str) -> list[ModelContract]:
        """Every valid contract named `name`; ModelNotFound (or the contract's error) when none."""
        entries = [e for e in self.scan() if e.name == name]
        good = [e.contract for e in entries if e.contract is not None]
        if good:
            return good
        if entries and entries[0].error:
            raise ContractInvalid(entries[0].error)
        raise ModelNotFound(f"model '{name}' is not in the repository")
