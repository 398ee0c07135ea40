"""What each runtime's zygote holds for the node's deployed models (the llm runtime: a GGUF mapped, its vocabulary
read), so that instances forked from it start without loading them (`ember.node.zygote`'s hold and drop ops)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ember.errors import WorkerCrashed
from ember.node.framing import Header
from ember.wire.contract import ModelContract

log = logging.getLogger("ember.node")

Call = Callable[[Header], Awaitable[Any]]   # a zygote link's `call`: one request, its reply frame


class ZygoteHolds:
    """The models a zygote was told to hold, by model key: told again when a zygote is made again, dropped when
    the model is released. A hold that fails costs the speed-up only: the instance then loads it all."""

    def __init__(self, contract_json: Callable[[ModelContract], dict[str, Any]]) -> None:
        self._contract_json = contract_json
        self._held: dict[str, ModelContract] = {}

    async def hold(self, call: Call, hello: Header, contract: ModelContract) -> bool:
        """Ask the zygote (greeted with `hello`) to hold the model; whether it does."""
        if not hello.get("holds"):
            return False
        self._held[contract.key] = contract   # before the ask: a release meanwhile finds it and sends a drop, which
        held = await self._ask(call, "hold", contract)   # the zygote runs after this hold (one link, in order)
        if not held and self._held.get(contract.key) is contract:
            del self._held[contract.key]
        return held

    async def held_again(self, call: Call, hello: Header, runtime: str) -> None:
        """A zygote made again for `runtime`: it holds what the one before it held."""
        for contract in [c for c in self._held.values() if c.runtime == runtime]:
            await self.hold(call, hello, contract)

    def release(self, model_key: str) -> ModelContract | None:
        """Forget the model; the contract to drop from its runtime's zygote, if it was held."""
        return self._held.pop(model_key, None)

    async def drop(self, call: Call, contract: ModelContract) -> None:
        await self._ask(call, "drop", contract)

    async def _ask(self, call: Call, op: str, contract: ModelContract) -> bool:
        try:
            reply = await call({"op": op, "contract": self._contract_json(contract)})
        except WorkerCrashed as err:
            log.warning("model '%s': the zygote did not %s it: %s", contract.key, op, err)
            return False
        if reply.op == "error":
            log.warning("model '%s': the zygote cannot %s it: %s", contract.key, op, reply.header.get("message"))
            return False
        if reply.header.get("threads", 1) != 1:
            log.warning("model '%s': the zygote has %s threads after %s: forking it is unsafe", contract.key,
                        reply.header["threads"], op)
        return bool(reply.header.get("held", op == "drop"))
