"""The model repository: the contract files ember was pointed at, parsed or not.

A bad contract is listed as UNAVAILABLE with the validation message; it never stops
the good ones from being served. Contract directories kept in the weight store (`--models store:NAME:VERSION`)
are listed once `fetch` has written them out on this node (`ember.serving.bundles`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ember.errors import ContractInvalid, EmberError, ModelNotFound
from ember.wire.contract import STORE_PREFIX, ModelContract, find_contracts, load_contract


@dataclass(frozen=True)
class Entry:
    path: Path
    contract: ModelContract | None
    error: str | None

    @property
    def name(self) -> str:
        return self.contract.name if self.contract is not None else self.path.stem


Stamp = tuple[str, int, int]   # (path, mtime_ns, size): a file with the same stamp is not read again


class Bundles(Protocol):
    """Contract directories in the weight store (`ember.serving.bundles.StoreBundles`); both calls block."""

    def contracts(self, ref: str) -> list[ModelContract]: ...

    def localize(self, contract: ModelContract) -> ModelContract: ...


class Repository:
    """The contract files of `sources`, then those of `defaults` (the bundled examples): a default whose
    `name:version` a source already defines is left out, so a copy of an example edited and served with
    --models replaces it rather than clashing with it."""

    def __init__(self, sources: list[Path], defaults: list[Path] | None = None, *,
                 refs: tuple[str, ...] = (), bundles: Bundles | None = None) -> None:
        self._sources = list(sources)
        self._defaults = list(defaults or [])
        # store objects (name:version) holding contract directories, and what fetching each gave (none yet: absent)
        self._refs, self._bundles = refs, bundles
        self._fetched: dict[str, list[ModelContract] | str] = {}
        # Parsed contracts (or their errors) by file stamp: a repository index runs on the event loop, and
        # reading and validating a YAML file costs about 11 ms.
        self._parsed: dict[Path, tuple[Stamp, ModelContract | None, str | None]] = {}

    def scan(self) -> list[Entry]:
        """Every contract file, read again when it changed (so edits are picked up by a repository load), then
        those of the store objects fetched, then the defaults'. A second file with a `name:version` an earlier one
        has is refused, naming both files: which one served would be luck."""
        entries: list[Entry] = []
        seen: dict[str, Path] = {}
        found: set[Path] = set()
        for source in self._sources:
            entries += self._file_entries(source, seen, found, default=False)
        entries += self._bundle_entries(seen)
        for source in self._defaults:
            entries += self._file_entries(source, seen, found, default=True)
        for gone in self._parsed.keys() - found:
            del self._parsed[gone]
        return entries

    def _file_entries(self, source: Path, seen: dict[str, Path], found: set[Path], *, default: bool) -> list[Entry]:
        entries: list[Entry] = []
        for path in find_contracts(source):
            found.add(path)
            contract, error = self._load(path)
            if contract is None:
                entries.append(Entry(path, None, error))
                continue
            first = seen.setdefault(contract.key, path)
            if first != path:
                if not default:
                    entries.append(Entry(path, None, f"{path}: model '{contract.key}' is already defined by {first}"))
                continue
            entries.append(Entry(path, contract, None))
        return entries

    def fetch(self) -> None:
        """Write out every store object of `refs` not written out yet (blocking: from a worker thread). One that
        cannot be fetched is listed with its error and tried again at the next fetch."""
        for ref in self._refs:
            if isinstance(self._fetched.get(ref), list):
                continue
            if self._bundles is None:
                self._fetched[ref] = f"{STORE_PREFIX}{ref}: this node has no weight store to read it from"
                continue
            try:
                self._fetched[ref] = self._bundles.contracts(ref)
            except EmberError as err:
                self._fetched[ref] = err.message

    def localize(self, contract: ModelContract) -> ModelContract:
        """`contract` read out of this node's own store when it came from one (blocking), else itself."""
        if contract.bundle is None:
            return contract
        if self._bundles is None:
            raise ContractInvalid(f"model '{contract.key}' is in the weight store ({STORE_PREFIX}{contract.bundle}) "
                                  "and this node has none")
        return self._bundles.localize(contract)

    def _bundle_entries(self, seen: dict[str, Path]) -> list[Entry]:
        entries: list[Entry] = []
        for ref in self._refs:
            fetched = self._fetched.get(ref, f"{STORE_PREFIX}{ref}: not fetched from the weight store yet")
            if isinstance(fetched, str):
                entries.append(Entry(Path(f"{STORE_PREFIX}{ref}"), None, fetched))
                continue
            for contract in fetched:
                path = Path(contract.source or f"{STORE_PREFIX}{ref}")
                first = seen.setdefault(contract.key, path)
                entries.append(Entry(path, contract, None) if first == path else
                               Entry(path, None, f"{STORE_PREFIX}{ref}: model '{contract.key}' is already defined "
                                                 f"by {first}"))
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
