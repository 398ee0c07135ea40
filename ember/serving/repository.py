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


Stamp = tuple[str, int, int]   # (path, mtime_ns, size): a file with the same stamp is not read again


class Repository:
    """The contract files of `sources`, then those of `defaults` (the bundled examples): a default whose
    `name:version` a source already defines is left out, so a copy of an example edited and served with
    --models replaces it rather than clashing with it."""

    def __init__(self, sources: list[Path], defaults: list[Path] | None = None) -> None:
        self._sources = list(sources)
        self._defaults = list(defaults or [])
        # Parsed contracts (or their errors) by file stamp: a repository index runs on the event loop, and
        # reading and validating a YAML file costs about 11 ms.
        self._parsed: dict[Path, tuple[Stamp, ModelContract | None, str | None]] = {}

    def scan(self) -> list[Entry]:
        """Every contract file, read again when it changed (so edits are picked up by a repository load). A
        second file with a `name:version` an earlier one has is refused, naming both files: which one served
        would be luck."""
        entries: list[Entry] = []
        seen: dict[str, Path] = {}
        found: set[Path] = set()
        for source, default in [(s, False) for s in self._sources] + [(d, True) for d in self._defaults]:
            for path in find_contracts(source):
                found.add(path)
                contract, error = self._load(path)
                if contract is None:
                    entries.append(Entry(path, None, error))
                    continue
                first = seen.setdefault(contract.key, path)
                if first != path:
                    if not default:
                        entries.append(Entry(path, None,
                                             f"{path}: model '{contract.key}' is already defined by {first}"))
                    continue
                entries.append(Entry(path, contract, None))
        for gone in self._parsed.keys() - found:
            del self._parsed[gone]
        return entries

    def _load(self, path: Path) -> tuple[ModelContract | None, str | None]:
        """The file's contract or its error, parsed again only when its stamp changed."""
        try:
            st = path.stat()
            stamp: Stamp | None = (str(path), st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None   # load_contract reports it
        cached = self._parsed.get(path)
        if stamp is not None and cached is not None and cached[0] == stamp:
            return cached[1], cached[2]
        try:
            contract, error = load_contract(path), None
        except ContractInvalid as err:
            contract, error = None, err.message
        if stamp is not None:
            self._parsed[path] = (stamp, contract, error)
        return contract, error

    def find(self, name: str) -> list[ModelContract]:
        """Every valid contract named `name`; ModelNotFound (or the contract's error) when none."""
        entries = [e for e in self.scan() if e.name == name]
        good = [e.contract for e in entries if e.contract is not None]
        if good:
            return good
        if entries and entries[0].error:
            raise ContractInvalid(entries[0].error)
        raise ModelNotFound(f"model '{name}' is not in the repository")
