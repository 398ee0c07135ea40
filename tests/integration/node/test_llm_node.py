"""The bundled SmolLM2 through LocalNode (real zygote, template and instance processes): streamed replies,
cancel mid-stream, and a prompt longer than the context, with the instance serving on after each."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.errors import Cancelled, InvalidInput
from ember.node import procinfo
from ember.node.local_node import LocalNode
from ember.node.replies import InstanceReplies
from ember.wire.contract import example_contracts_dir, load_contract

pytestmark = pytest.mark.slow

SMOLLM2 = load_contract(example_contracts_dir() / "smollm2.yaml")
CPUS = tuple(sorted(os.sched_getaffinity(0)))
# Not "What is the capital of France?": its first token is a 0.1-logit near-tie in llama.cpp's Q4_1 logits, and
# greedy decoding then wanders ("L'Étoile, ...") without naming Paris (docs/llm.md, near-ties).
PARIS = {"messages": [{"role": "user", "content": "Answer in one word: what is the capital of France?"}],
         "temperature": 0}


def request(**fields: Any) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    return {"request": arr}


async def drain(replies: InstanceReplies) -> list[dict[str, np.ndarray]]:
    return [reply async for reply in replies]


def text_of(replies: list[dict[str, np.ndarray]]) -> str:
    return "".join(bytes(r["text"][0]).decode() for r in replies)


@asynccontextmanager
async def smollm2_instance(store: Path) -> AsyncIterator[tuple[LocalNode, str]]:
    """A node whose zygote and template use `store` as the weight-store root, and one instance forked from the
    template on every core here."""
    state = tempfile.mkdtemp(prefix="ember-llm-", dir="/tmp")   # short: Unix socket paths are limited
    node = LocalNode(state, env={"EMBER_STORE": str(store)}, ready_timeout_s=300)
    try:
        await node.prepare(SMOLLM2)
        slice_ = Slice(id="cpu-all", kind="cpu", memory_mb=1024, cpus=CPUS, threads=len(CPUS))
        started = await node.start(SMOLLM2, Rung.TEMPLATE, slice_)
        yield node, started.instance_id
    finally:
        await node.close()
        shutil.rmtree(state, ignore_errors=True)


def test_a_chat_streams_token_by_token_from_a_template_fork(llm_store: Path) -> None:
    async def main() -> None:
        async with smollm2_instance(llm_store) as (node, iid):
            for tag in ("zygote:llm", f"template:{SMOLLM2.key}"):   # preload, load (the GGUF mapped) and the
                assert procinfo.thread_count(node.pids()[tag]) == 1, tag   # template's warm-up start no pool
            replies = await drain(await node.open(iid, request(**PARIS)))
            assert len(replies) > 2 and "Paris" in text_of(replies)
            # The template's warm-up ("Hi", after the chat template's default system prompt) filled the prefix
            # cache that the replica inherited: the question's prompt starts with those tokens.
            assert int(replies[-1]["cached_tokens"][0]) >= 16
            assert [bytes(r["finish_reason"][0]) for r in replies] == [b""] * (len(replies) - 1) + [b"stop"]
            # The end-of-sequence token that ends it is not counted (as llama.cpp's server and vLLM count).
            assert [int(r["completion_tokens"][0]) for r in replies] == [*range(1, len(replies)), len(replies) - 1]
            assert len({int(r["prompt_tokens"][0]) for r in replies}) == 1
            cut = await drain(await node.open(iid, request(**PARIS, max_tokens=3)))
            assert len(cut) == 3 and bytes(cut[-1]["finish_reason"][0]) == b"length"
            assert text_of(replies).startswith(text_of(cut))

    asyncio.run(main())


def test_cancel_mid_stream_and_an_overlong_prompt_leave_the_instance_serving(llm_store: Path) -> None:
    async def main() -> None:
        async with smollm2_instance(llm_store) as (node, iid):
            story = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
                     "temperature": 0, "max_tokens": 500}   # ~20 s if left alone
            replies = await node.open(iid, request(**story))
            for _ in range(3):
                await replies.__anext__()
            asked = time.monotonic()
            replies.cancel()
            await asyncio.wait_for(replies.settled(), 2)
            settled_s = time.monotonic() - asked
            with pytest.raises(Cancelled):
                await drain(replies)   # replies already on their way, then the cancel
            assert settled_s < 1.0, settled_s   # stopped at the next token, not at the end of the story

            after = await asyncio.wait_for(drain(await node.open(iid, request(**PARIS))), 30)
            assert "Paris" in text_of(after)

            long = {"messages": [{"role": "user", "content": "hello " * 9000}]}
            with pytest.raises(InvalidInput, match=r"^messages: prompt of \d+ tokens exceeds the context of 8192"):
                await drain(await node.open(iid, request(**long)))
            with pytest.raises(InvalidInput, match="^max_tokens: 9000 exceeds the context of 8192"):
                await drain(await node.open(iid, request(**PARIS, max_tokens=9000)))
            again = await asyncio.wait_for(drain(await node.open(iid, request(**PARIS))), 30)
            assert text_of(again) == text_of(after)

    asyncio.run(main())


def test_a_sandboxed_instance_hands_its_learned_prefix_to_the_node_which_keeps_it(store_root: Path) -> None:
    """The instance sees the weight store read-only (its sandbox, where this machine allows the step): what it
    learned reaches the store through its drained frame and the node (ember/node/keeping.py). A store of its own:
    the session's (llm_store) holds only declared prefixes, as the runtime tests expect."""
    system = "You are a pirate captain. Answer every question in the voice of a pirate, with nautical words. " * 3
    questions = ["What is a ship?", "Where is the sea?", "Why is water wet?"]

    def listed() -> list[str]:
        lists = list((store_root / "prefixes").glob("*.json"))
        return json.loads(lists[0].read_text())["snapshots"] if lists else []

    async def main() -> None:
        before = listed()
        async with smollm2_instance(store_root) as (node, iid):
            found = node.startup(iid)["sandbox"]
            assert "filesystem:read-only" in found["enforced"] or found["skipped"].get("filesystem:read-only")
            def ask(question: str) -> dict[str, np.ndarray]:
                return request(messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                               max_tokens=1, temperature=0)

            for question in questions:   # the first leaves the system prompt's prefix, the next two hit it
                hit = await drain(await node.open(iid, ask(question)))
            assert int(hit[-1]["cached_tokens"][0]) > 0
            # The same prompt for a caller of tenant beta: none of it from the cache (the tenant reaches the
            # instance in the request's frame; docs/llm.md, one tenant's prompts never serve another's).
            other = await drain(await node.open(iid, ask(questions[-1]), tenant="beta"))
            assert int(other[-1]["cached_tokens"][0]) == 0
            await node.stop(iid)
            assert iid not in node.pids()
        (new, *_rest) = listed()
        assert new not in before
        assert (store_root / "manifests" / new.removesuffix(":1") / "1.json").is_file()

    asyncio.run(main())


def test_the_zygote_holds_each_models_weights_and_an_instance_maps_only_its_own(llm_store: Path,
                                                                                  tmp_path: Path) -> None:
    """Deploying maps a model's GGUF in the llm zygote (no thread starts); an instance forked from it keeps its own
    model's mapping and lets the others go; releasing a model lets the zygote drop it."""
    gguf = SMOLLM2.weights_path()
    assert gguf is not None
    twin_path = tmp_path / "twin.gguf"
    shutil.copyfile(gguf, twin_path)
    scaling = SMOLLM2.scaling.model_copy(update={"keep_template": False})
    first = SMOLLM2.model_copy(update={"scaling": scaling})
    twin = SMOLLM2.model_copy(update={"name": "smollm2-twin", "weights": str(twin_path), "scaling": scaling})

    def mapped(pid: int) -> set[str]:
        return {path for _, _, path in procinfo.file_mappings(pid)} & {str(gguf), str(twin_path)}

    async def main() -> None:
        state = tempfile.mkdtemp(prefix="ember-llm-", dir="/tmp")
        node = LocalNode(state, env={"EMBER_STORE": str(llm_store)}, ready_timeout_s=300)
        try:
            await node.prepare(first)
            await node.prepare(twin)
            zygote = node.pids()["zygote:llm"]
            assert mapped(zygote) == {str(gguf), str(twin_path)}
            assert procinfo.thread_count(zygote) == 1
            slice_ = Slice(id="cpu-all", kind="cpu", memory_mb=1024, cpus=CPUS, threads=len(CPUS))
            started = await node.start(first, Rung.ZYGOTE, slice_)
            assert mapped(started.pid) == {str(gguf)}
            replies = await drain(await node.open(started.instance_id, request(**PARIS)))
            assert "Paris" in text_of(replies)
            await node.release(twin.key)
            assert mapped(zygote) == {str(gguf)}
        finally:
            await node.close()
            shutil.rmtree(state, ignore_errors=True)

    asyncio.run(main())
