"""A node's process images and the instances it restores from them (the ladder's RESTORE rung).

With snapshots on (`ember serve --snapshots on`, and CRIU >= 4.1 usable here: `ember.node.criu`), preparing a
model also makes its image under `state_dir/images` (0700), off the request path and one at a time
(`ember.node.snapshots`: a process of its own loads and warms the model as the node, outside any sandbox, and is
dumped; one load of the model, once per contract and host). An image survives the node: a restarted node on the
same state dir finds it, checked against this host's CPU, CRIU, ember's environment, the files it maps and the
contract (one that does not match is made again, with the reason logged). It is kept in the weight store too, where
a node without one takes it from (its own store, or a peer's: `ember.node.image_sharing`). A node that finds an
image when it prepares the model restores the model's template from it instead of loading it. Releasing the model
deletes the image.

Only runtimes whose load runs ember's own code are imaged (sentence-transformers, llm): the python runtime's load
is the model's code, which runs only inside its sandbox; vllm runs in an environment of its own; a model whose
weights are in the weight store is not imaged yet. Each says why once in the log and keeps the other rungs.

An instance on the RESTORE rung is a copy of that process, restored in a pid namespace of its own by a CRIU that
runs in the instance's cgroups (so what it restores is charged there) and dies with the node; the copy then
enters its sandbox (mount namespace and view, the model's user, no network, seccomp) and its slice, and greets
the node like any instance. Its model was loaded outside the sandbox, by ember's code, before any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ember.errors import EmberError
from ember.node import criu, image_sharing, snapshots
from ember.node.framing import HEADERS_ONLY, Header, recv_frame, send_frame
from ember.store.store import WeightStore
from ember.wire.contract import RUNTIME_ENVIRONMENTS, ModelContract

log = logging.getLogger("ember.node")


class NodeImages:
    def __init__(self, root: Path, requested: bool, env: Callable[[], Mapping[str, str]],
                 store: Callable[[ModelContract], WeightStore | None] = lambda _: None) -> None:
        """`store`: the node's weight store (None: none), where images are kept and taken from
        (`ember.node.image_sharing`)."""
        self.root, self._env, self._store = root, env, store
        found = criu.find() if requested else None
        self.enabled = found is not None and found.ok
        self.state = "off (ember serve --snapshots on turns them on)" if found is None else \
            f"on (CRIU {found.version})" if found.ok else f"off ({found.reason})"
        if found is not None and not found.ok:
            log.warning("snapshots: off (%s); models start from their other rungs", found.reason)
        self._ready: dict[str, str] = {}      # model key -> the contract (as text) its image on disk was made for
        self._failed: dict[str, str] = {}     # model key -> the contract whose image could not be made (not again)
        self._made: dict[str, dict[str, float]] = {}   # model key -> the image's MiB, and its load and dump seconds
        self._making: set[str] = set()
        self._contracts: dict[str, ModelContract] = {}   # model key -> its contract, for the store's image name
        self._locks: dict[str, asyncio.Lock] = {}   # model key -> held while its image is checked, taken or made
        self._released: set[str] = set()   # models released since their image's make began
        self.made = 0   # images made since the node started (each a load of its model)
        self._hosts: set[subprocess.Popen[bytes]] = set()   # snapshot hosts loading now (killed on close)
        self._one_at_a_time = asyncio.Semaphore(1)   # each make is a whole load of its model: never two at once

    def path(self, contract: ModelContract) -> Path:
        return self.root / hashlib.sha256(contract.key.encode()).hexdigest()[:16]

    def ready(self, contract: ModelContract) -> bool:
        """A compatible image of this very contract is on disk (an edited contract's old image is not)."""
        return self.enabled and self._ready.get(contract.key) == snapshots.contract_text(contract)

    async def found(self, contract: ModelContract) -> bool:
        """A compatible image of this contract is on disk already (made before a restart), or taken from the weight
        store (this node's or a peer's: made on another node): checked, never made."""
        if not self.enabled or self._failed.get(contract.key) == snapshots.contract_text(contract):
            return False
        if self.ready(contract):
            return True
        if snapshot_refused(contract) is not None:
            return False
        self._contracts[contract.key] = contract
        async with self._lock(contract.key):   # not beside a make or another take of the same image
            return self.ready(contract) or await self._check_or_take(contract)

    async def _check_or_take(self, contract: ModelContract) -> bool:
        path = self.path(contract)
        why = await asyncio.to_thread(snapshots.compatible, path, contract)
        if why is not None and await asyncio.to_thread(self._take, contract, path):
            why = await asyncio.to_thread(snapshots.compatible, path, contract)
            if why is not None:
                log.warning("snapshots: model '%s': the image in the store cannot be restored here (%s)",
                            contract.key, why)
            else:
                log.info("snapshots: model '%s': image taken from the weight store", contract.key)
        if why is not None:
            return False
        self._ready[contract.key] = snapshots.contract_text(contract)
        self._found_on_disk(contract.key, path)
        return True

    def _found_on_disk(self, key: str, path: Path) -> None:
        """An image this node did not make now: its size (its load and dump times are unknown here)."""
        self._made.setdefault(key, {"mb": round(snapshots.image_bytes(path) / 2**20, 1)})

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    def _take(self, contract: ModelContract, path: Path) -> bool:
        store = self._open_store(contract)
        if store is None:
            return False
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            return image_sharing.take(store, path, contract)
        except (EmberError, OSError) as err:   # the model is prepared as without an image: loaded
            log.warning("snapshots: model '%s': its image could not be taken from the weight store (%s)",
                        contract.key, err)
            return False

    def _publish(self, contract: ModelContract, path: Path) -> None:
        store = self._open_store(contract)
        if store is not None:
            image_sharing.publish(store, path, contract)

    def _open_store(self, contract: ModelContract) -> WeightStore | None:
        try:
            return self._store(contract)
        except EmberError as err:
            log.warning("snapshots: model '%s': no weight store for its image (%s)", contract.key, err.message)
            return None

    def forkable(self, contract: ModelContract) -> bool:
        """Its image's process had one thread: a copy may be the model's template (it forks replicas)."""
        return self.ready(contract) and snapshots.threads(self.path(contract)) == 1

    async def ensure(self, contract: ModelContract) -> None:
        """The model's image, checked if on disk, else made (one make at a time; a failure is logged and not tried
        again for the same contract)."""
        text = snapshots.contract_text(contract)
        if not self.enabled or contract.key in self._making or self._failed.get(contract.key) == text:
            return
        if self.ready(contract):   # checked already (`found`, at this very prepare): not again
            return
        why_not = snapshot_refused(contract)
        if why_not is not None:
            if self._failed.get(contract.key) != text:
                log.info("snapshots: model '%s' has no image: %s", contract.key, why_not)
            self._failed[contract.key] = text
            return
        self._making.add(contract.key)
        self._released.discard(contract.key)
        try:
            async with self._one_at_a_time, self._lock(contract.key):
                await self._check_or_make(contract)
            if contract.key in self._released:   # released while its image was made: the image goes too
                self._contracts[contract.key] = contract
                self.drop(contract.key)
                return
            self._ready[contract.key] = text
        except Exception as err:
            self._failed[contract.key] = text
            log.warning("snapshots: model '%s': no image (%s); it starts from its other rungs", contract.key, err)
        finally:
            self._making.discard(contract.key)

    async def _check_or_make(self, contract: ModelContract) -> None:
        path = self.path(contract)
        why = await asyncio.to_thread(snapshots.compatible, path, contract)
        if why is None:
            self._found_on_disk(contract.key, path)
            return
        if (path / "ember.json").exists():
            log.info("snapshots: model '%s': its image is made again (%s)", contract.key, why)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)   # images hold the model's memory: for the node alone
        image = await asyncio.to_thread(snapshots.make_image, contract, path, env=self._env(),
                                        on_start=self._hosts.add)
        self._hosts.clear()
        self._contracts[contract.key] = contract
        try:   # for other nodes, and for this one should its images directory go
            await asyncio.to_thread(self._publish, contract, path)
        except (EmberError, OSError) as err:
            log.warning("snapshots: model '%s': its image is not in the weight store (%s)", contract.key, err)
        log.info("snapshots: model '%s': image of %.0f MiB made (load %.2f s, dump %.2f s)", contract.key,
                 image.bytes / 2**20, image.load_s, image.dump_s)
        self._made[contract.key] = {"mb": round(image.bytes / 2**20, 1), "load_s": round(image.load_s, 3),
                                    "dump_s": round(image.dump_s, 3)}
        self.made += 1

    def forget(self, contract: ModelContract, why: str) -> None:
        """The image did not restore: not used again for this contract (until the node restarts)."""
        if self._ready.pop(contract.key, None) is not None:
            log.warning("snapshots: model '%s': its image is not used again (%s)", contract.key, why)
        self._failed[contract.key] = snapshots.contract_text(contract)

    def drop(self, model_key: str) -> None:
        """The model is released from this node: its image goes too (from the store as well)."""
        self._released.add(model_key)
        self._ready.pop(model_key, None)
        self._made.pop(model_key, None)
        contract = self._contracts.pop(model_key, None)
        store = None if contract is None else self._open_store(contract)
        if contract is not None and store is not None:
            with contextlib.suppress(EmberError, OSError):
                image_sharing.withdraw(store, contract)
        path = self.root / hashlib.sha256(model_key.encode()).hexdigest()[:16]
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        for host in list(self._hosts):
            with contextlib.suppress(OSError):
                host.kill()

    def status(self) -> dict[str, object]:
        """`ember status`'s view: whether snapshots run, and each model's image (MiB; load and dump seconds when
        this node made it; how many processes, templates and instances, it restored)."""
        images = [{"model": key, **self._made.get(key, {})} for key in sorted(self._ready)]
        return {"state": self.state, "images": images}

    async def restore(self, contract: ModelContract, cgroup_procs: Sequence[Path] = ()) -> snapshots.Restored:
        restored = await asyncio.to_thread(snapshots.restore, self.path(contract), cgroup_procs=cgroup_procs)
        made = self._made.setdefault(contract.key, {})
        made["restores"] = made.get("restores", 0) + 1
        return restored


async def exit_status(proc: subprocess.Popen[bytes]) -> int:
    """The process's exit status, waited for without a thread (a pidfd on the event loop)."""
    loop = asyncio.get_running_loop()
    fd = os.pidfd_open(proc.pid)
    exited: asyncio.Future[None] = loop.create_future()
    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return proc.wait()


# Runtimes whose load runs ember's code only (a snapshot host loads as the node, outside the model's sandbox).
IMAGED_RUNTIMES = frozenset({"sentence-transformers", "llm"})


def snapshot_refused(contract: ModelContract) -> str | None:
    """Why a model gets no image (None: it may). A snapshot host loads outside the model's sandbox, so only the
    runtimes whose load runs ember's own code are imaged (the python runtime's `load()` is the model's); not one in
    an environment of its own (vllm: its engine's worker processes are not the host's to dump); not yet a model
    whose weights are in the weight store."""
    if contract.runtime in RUNTIME_ENVIRONMENTS:
        return f"the {contract.runtime} runtime runs in an environment of its own, which snapshots do not cover"
    if contract.runtime not in IMAGED_RUNTIMES:
        return f"the {contract.runtime} runtime's load may run the model's own code, which runs only in its sandbox"
    if contract.store_ref is not None:
        return "its weights are in the weight store, which a snapshot host does not open yet"
    return None


def become(restored: snapshots.Restored, command: Header) -> None:
    """Tell a restored copy what it becomes (`command`: `{op: become}`, an instance, or `{op: become_template}`);
    it binds its socket and leaves this connection (blocking)."""
    send_frame(restored.conn, {"op": "become", **command})
    reply = recv_frame(restored.conn, HEADERS_ONLY)
    restored.conn.close()
    if reply is None or reply.op != "bound":
        message = reply.header.get("message") if reply is not None else "it closed the connection"
        raise RuntimeError(f"the restored process refused to become what it was told: {message}")
