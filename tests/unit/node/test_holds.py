"""What the node tells its zygotes to hold (ember.node.holds), against a fake zygote's link."""

from __future__ import annotations

import asyncio
from typing import Any

from ember.errors import WorkerCrashed
from ember.node.framing import Frame, Header
from ember.node.holds import ZygoteHolds
from ember.wire.contract import ModelContract, parse_contract


def contract(name: str, runtime: str = "llm") -> ModelContract:
    return parse_contract({
        "name": name, "runtime": runtime, "weights": f"/models/{name}.gguf",
        "inputs": [{"name": "request", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}],
    })


class FakeZygote:
    """A zygote's link: holds what it is told to (unless `refuse`), answers as `ember.node.zygote.hold` does."""

    def __init__(self, *, refuse: str | None = None, crashed: bool = False, threads: int = 1) -> None:
        self.held: set[str] = set()
        self.refuse, self.crashed, self.threads = refuse, crashed, threads
        self.ops: list[str] = []
        self.gate: asyncio.Event | None = None   # set: a hold waits for it (a slow load)
        self._in_order: asyncio.Lock | None = None   # one link, one loop: commands run in the order they came

    async def call(self, header: Header) -> Frame:
        if self._in_order is None:
            self._in_order = asyncio.Lock()
        async with self._in_order:
            if self.gate is not None and header["op"] == "hold":
                await self.gate.wait()
            return self._answer(header)

    def _answer(self, header: Header) -> Frame:
        self.ops.append(str(header["op"]))
        if self.crashed:
            raise WorkerCrashed("zygote gone")
        name = header["contract"]["name"]
        if name == self.refuse:
            return Frame({"op": "error", "kind": "ModelNotReady", "message": f"cannot load {name}"})
        if header["op"] == "hold":
            self.held.add(name)
        else:
            self.held.discard(name)
        return Frame({"op": "held", "held": header["op"] == "hold", "threads": self.threads})


def as_json(c: ModelContract) -> dict[str, Any]:
    return c.model_dump(mode="json", exclude={"source"})


def test_a_zygote_that_can_hold_holds_and_drops_on_release() -> None:
    holds, zygote = ZygoteHolds(as_json), FakeZygote()

    async def main() -> None:
        assert await holds.hold(zygote.call, {"holds": True}, contract("a"))
        assert zygote.held == {"a"}
        held = holds.release("a:1")
        assert held is not None
        await holds.drop(zygote.call, held)
        assert zygote.held == set() and holds.release("a:1") is None

    asyncio.run(main())


def test_a_zygote_that_cannot_hold_is_not_asked() -> None:
    holds, zygote = ZygoteHolds(as_json), FakeZygote()
    assert not asyncio.run(holds.hold(zygote.call, {"holds": False}, contract("a")))
    assert zygote.ops == [] and holds.release("a:1") is None


def test_a_refused_or_crashed_hold_costs_only_the_speed_up() -> None:
    holds = ZygoteHolds(as_json)

    async def main() -> None:
        assert not await holds.hold(FakeZygote(refuse="a").call, {"holds": True}, contract("a"))
        assert not await holds.hold(FakeZygote(crashed=True).call, {"holds": True}, contract("b"))

    asyncio.run(main())
    assert holds.release("a:1") is None and holds.release("b:1") is None


def test_a_zygote_made_again_holds_what_its_runtime_held() -> None:
    holds = ZygoteHolds(as_json)

    async def main() -> None:
        first = FakeZygote()
        for c in (contract("a"), contract("b"), contract("c", runtime="sentence-transformers")):
            await holds.hold(first.call, {"holds": True}, c)
        again = FakeZygote()
        await holds.held_again(again.call, {"holds": True}, "llm")
        assert again.held == {"a", "b"}

    asyncio.run(main())


def test_a_model_released_while_its_hold_is_under_way_is_dropped_after_it() -> None:
    holds, zygote = ZygoteHolds(as_json), FakeZygote()

    async def main() -> None:
        zygote.gate = asyncio.Event()
        holding = asyncio.create_task(holds.hold(zygote.call, {"holds": True}, contract("a")))
        await asyncio.sleep(0)
        held = holds.release("a:1")
        assert held is not None
        dropping = asyncio.create_task(holds.drop(zygote.call, held))
        await asyncio.sleep(0)
        zygote.gate.set()
        await asyncio.gather(holding, dropping)
        assert zygote.ops == ["hold", "drop"] and zygote.held == set()
        assert holds.release("a:1") is None

    asyncio.run(main())
