"""A node's process images and the instances it restores from them (the ladder's RESTORE rung).

With snapshots on (`ember serve --snapshots on`, and CRIU >= 4.1 usable here: `ember.node.criu`), preparing a
model also makes its image under `state_dir/images`, off the request path (`ember.node.snapshots`: a process of
its own loads and warms the model and is dumped; about one load of the model, once per contract and host). An
image survives the node: a restarted node on the same state dir finds it, checked against this host's CPU, CRIU
and the contract (an image that does not match is made again, with the reason logged).

Models of the python runtime (whose load runs the model's own code, which must run only inside its sandbox) and
of runtimes in environments of their own (vllm) get no image, said once in the log: they keep the other rungs.

An instance on the RESTORE rung is a copy of that process, restored in a pid namespace of its own, which then
enters its sandbox and slice as a zygote's child does after its load and greets the node like any instance.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from ember.node import criu, snapshots
from ember.node.framing import HEADERS_ONLY, Header, recv_frame, send_frame
from ember.wire.contract import RUNTIME_ENVIRONMENTS, ModelContract

log = logging.getLogger("ember.node")


class NodeImages:
    def __init__(self, root: Path, requested: bool, env: Callable[[], Mapping[str, str]]) -> None:
        self.root, self._env = root, env
        found = criu.find() if requested else None
        self.enabled = found is not None and found.ok
        self.state = "off (ember serve --snapshots on turns them on)" if found is None else \
            f"on (CRIU {found.version})" if found.ok else f"off ({found.reason})"
        if found is not None and not found.ok:
            log.warning("snapshots: off (%s); models start from their other rungs", found.reason)
        self._ready: dict[str, bool] = {}     # model key -> a compatible image is on disk
        self._made: dict[str, dict[str, float]] = {}   # model key -> the image's MiB, and its load and dump seconds
        self._making: set[str] = set()

    def path(self, contract: ModelContract) -> Path:
        return self.root / hashlib.sha256(contract.key.encode()).hexdigest()[:16]

    def ready(self, contract: ModelContract) -> bool:
        return self.enabled and self._ready.get(contract.key, False)

    async def ensure(self, contract: ModelContract) -> None:
        """The model's image, checked if on disk, else made (once at a time per model; failures logged)."""
        if not self.enabled or contract.key in self._making:
            return
        why_not = snapshot_refused(contract)
        if why_not is not None:
            if contract.key not in self._ready:
                log.info("snapshots: model '%s' has no image: %s", contract.key, why_not)
            self._ready[contract.key] = False
            return
        self._making.add(contract.key)
        try:
            why = await asyncio.to_thread(snapshots.compatible, self.path(contract), contract)
            if why is not None:
                if (self.path(contract) / "ember.json").exists():
                    log.info("snapshots: model '%s': its image is made again (%s)", contract.key, why)
                image = await asyncio.to_thread(snapshots.make_image, contract, self.path(contract), env=self._env())
                log.info("snapshots: model '%s': image of %.0f MiB made (load %.2f s, dump %.2f s)", contract.key,
                         image.bytes / 2**20, image.load_s, image.dump_s)
                self._made[contract.key] = {"mb": round(image.bytes / 2**20, 1), "load_s": round(image.load_s, 3),
                                            "dump_s": round(image.dump_s, 3)}
            else:
                size = sum(p.stat().st_size for p in self.path(contract).iterdir() if p.is_file())
                self._made.setdefault(contract.key, {"mb": round(size / 2**20, 1)})
            self._ready[contract.key] = True
        except Exception as err:
            self._ready[contract.key] = False
            log.warning("snapshots: model '%s': no image (%s); it starts from its other rungs", contract.key, err)
        finally:
            self._making.discard(contract.key)

    def forget(self, contract: ModelContract) -> None:
        self._ready.pop(contract.key, None)

    def status(self) -> dict[str, object]:
        """`ember status`'s view: whether snapshots run, and each model's image (MiB; load and dump seconds when
        this node made it)."""
        images = [{"model": key, **self._made.get(key, {})} for key, ready in sorted(self._ready.items()) if ready]
        return {"state": self.state, "images": images}

    async def restore(self, contract: ModelContract) -> snapshots.Restored:
        return await asyncio.to_thread(snapshots.restore, self.path(contract))


def snapshot_refused(contract: ModelContract) -> str | None:
    """Why a model gets no image (None: it may). A snapshot host loads outside the model's sandbox, so a runtime
    whose load runs the model's own code (`sandboxed_load`: the python runtime's `load()`) is never imaged; nor
    one in an environment of its own (vllm: its engine's worker processes are not the host's to dump)."""
    from ember.runtimes import get_runtime

    if contract.runtime in RUNTIME_ENVIRONMENTS:
        return f"the {contract.runtime} runtime runs in an environment of its own, which snapshots do not cover"
    if getattr(get_runtime(contract.runtime), "sandboxed_load", False):
        return f"the {contract.runtime} runtime's load runs the model's own code, which runs only in its sandbox"
    return None


def become(restored: snapshots.Restored, command: Header) -> None:
    """Tell a restored copy which instance it is; it binds its socket and leaves this connection (blocking)."""
    send_frame(restored.conn, {"op": "become", **command})
    reply = recv_frame(restored.conn, HEADERS_ONLY)
    restored.conn.close()
    if reply is None or reply.op != "bound":
        message = reply.header.get("message") if reply is not None else "it closed the connection"
        raise RuntimeError(f"the restored process refused to become an instance: {message}")
