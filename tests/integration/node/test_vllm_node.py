"""The vllm runtime through LocalNode, in the `vllm` environment (real zygote in that environment's interpreter,
an instance forked from it that builds vLLM's engine): streamed replies in the llm convention, concurrent streams
in one engine, cancel mid-stream, a bad request refused with the instance serving on, pause and resume, no sleep
mode on the CPU build.

Needs the environment built (`ember env build vllm`, ~3.5 GB, a few minutes): skipped with that reason otherwise.
The model is a random-weight two-layer Llama with SmolLM2's tokenizer (ember.testing.hf_models), so text is noise;
what is checked is the protocol and the engine's behaviour, not the words.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.environments.registry import Environments
from ember.errors import Cancelled, InvalidInput
from ember.node import procinfo
from ember.node.local_node import LocalNode
from ember.node.replies import InstanceReplies
from ember.testing.hf_models import vllm_contract_data
from ember.wire.contract import ModelContract, parse_contract

ENV = Environments().status("vllm")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ENV.built, reason=f"vllm runtime: {ENV.reason or 'not built'}")]

CPUS = tuple(sorted(os.sched_getaffinity(0)))
OUTPUTS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "logprobs")


def vllm_contract(weights: Path, name: str = "tiny-vllm", **extra: Any) -> ModelContract:
    return parse_contract(vllm_contract_data(
        name, weights, OUTPUTS,
        warmup={"requests": 1, "inputs": {"request": ['{"prompt": "Hi", "max_tokens": 1}']}}, **extra))


def request(**fields: Any) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    return {"request": arr}


async def drain(replies: InstanceReplies) -> list[dict[str, np.ndarray]]:
    return [reply async for reply in replies]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ember.testing.hf_models import tiny_llama_hf

    return tiny_llama_hf(tmp_path_factory.mktemp("hf") / "tiny-llama")


@asynccontextmanager
async def vllm_instance(contract: ModelContract) -> AsyncIterator[tuple[LocalNode, str]]:
    state = tempfile.mkdtemp(prefix="ember-vllm-", dir="/tmp")
    node = LocalNode(state, ready_timeout_s=300, sandbox=False)
    try:
        await node.prepare(contract)
        slice_ = Slice(id="cpu-all", kind="cpu", memory_mb=4096, cpus=CPUS, threads=1)
        started = await node.start(contract, Rung.ZYGOTE, slice_)
        yield node, started.instance_id
    finally:
        await node.close()
        shutil.rmtree(state, ignore_errors=True)


def test_streams_concurrently_cancels_refuses_and_pauses(tiny_hf: Path) -> None:
    contract = vllm_contract(tiny_hf)

    async def main() -> None:
        async with vllm_instance(contract) as (node, iid):
            assert procinfo.thread_count(node.pids()["zygote:vllm"]) == 1   # vllm and torch imported, no pool
            assert not node.has_template(contract.key)                      # keep_template defaults to false
            replies = await drain(await node.open(iid, request(prompt="Once upon a time", max_tokens=12,
                                                                temperature=0, logprobs=True, top_logprobs=2)))
            assert [bytes(r["finish_reason"][0]) for r in replies] == [b""] * (len(replies) - 1) + [b"length"]
            assert int(replies[-1]["completion_tokens"][0]) == 12
            first = json.loads(bytes(replies[0]["logprobs"][0]))
            assert first[0]["logprob"] <= 0 and len(first[0]["top_logprobs"]) == 2

            # Eight greedy streams at once, one engine: each gets the same completion as alone.
            alone = b"".join(bytes(r["text"][0]) for r in replies)
            opened = [await node.open(iid, request(prompt="Once upon a time", max_tokens=12, temperature=0))
                      for _ in range(8)]
            many = await asyncio.gather(*(drain(replies) for replies in opened))
            assert all(b"".join(bytes(r["text"][0]) for r in rs) == alone for rs in many)

            with pytest.raises(InvalidInput, match="^max_tokens: 5000 exceeds the context of 1024"):
                await drain(await node.open(iid, request(prompt="Hi", max_tokens=5000)))
            with pytest.raises(InvalidInput, match="^tools: the model.s chat template has no tool format"):
                await drain(await node.open(iid, request(messages=[{"role": "user", "content": "Hi"}], tools=[
                    {"type": "function", "function": {"name": "f"}}])))

            stream = await node.open(iid, request(prompt="Hi", max_tokens=500, temperature=0))
            await stream.__anext__()
            stream.cancel()
            with pytest.raises(Cancelled):
                await drain(stream)

            await node.pause(iid)
            await node.resume(iid)
            chat = await drain(await node.open(iid, request(messages=[{"role": "user", "content": "Hi"}],
                                                            max_tokens=3, temperature=0)))
            assert int(chat[-1]["completion_tokens"][0]) == 3 and int(chat[-1]["prompt_tokens"][0]) > 5

            # vLLM's CPU build has no sleep mode: the instance offers no level (its node pauses it instead).
            with pytest.raises(InvalidInput, match="cannot sleep at 1"):
                await node.sleep(iid, 1)

    asyncio.run(main())



def test_a_vllm_model_in_the_store_is_fetched_from_the_origin_and_greedy_is_unchanged(tiny_hf: Path) -> None:
    """The fetch rung for vLLM: the Hugging Face directory pushed as it is to an origin (nginx); a node with an
    empty store starts it on the fetch rung and serves the same greedy tokens as from the directory itself."""
    from ember.store import StoreConfig, WeightStore
    from ember.testing.nginx import NginxOrigin, available

    if not available():
        pytest.skip("nginx is not installed (make system)")
    base = Path(tempfile.mkdtemp(prefix="ember-vllm-fetch-", dir="/tmp"))
    ask = request(prompt="Once upon a time", max_tokens=8, temperature=0)

    async def main(origin: NginxOrigin) -> None:
        async with vllm_instance(vllm_contract(tiny_hf)) as (node, iid):
            expected = b"".join(bytes(r["text"][0]) for r in await drain(await node.open(iid, ask)))
        contract = vllm_contract(Path("unused"), name="tiny-vllm-store").model_copy(update={"weights": "store:tiny:1"})
        node = LocalNode(base / "state", ready_timeout_s=300, sandbox=False,
                         store=StoreConfig(root=base / "node", memory_dir=None, origin=origin.url))
        try:
            assert not node.weights_local(contract)
            await node.prepare(contract)
            started = await node.start(contract, Rung.FETCH, Slice(id="cpu-all", kind="cpu", memory_mb=4096,
                                                                    cpus=CPUS, threads=1))
            assert started.rung is Rung.FETCH and node.weights_local(contract)
            got = b"".join(bytes(r["text"][0]) for r in await drain(await node.open(started.instance_id, ask)))
            assert got == expected
            assert [p for p in origin.requests() if "/chunks/" in p]   # the weights came from the origin
        finally:
            await node.close()

    try:
        with WeightStore(StoreConfig(root=base / "origin", memory_dir=None)) as publisher:
            publisher.push(tiny_hf, "tiny:1")
        with NginxOrigin(base / "origin") as origin:
            asyncio.run(main(origin))
    finally:
        shutil.rmtree(base, ignore_errors=True)
