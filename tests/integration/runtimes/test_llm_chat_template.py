"""A GGUF without a chat template (a base model's conversion) serves chat and tools with the contract's own
template (options.chat_template_file, beside the contract): its warm-up, a chat, a tool call forced by the grammar
of the format the template teaches, and the gateway's prompt check, all through the same template.

The model is tiny and random (ember.testing.gguf_models, written without a template): its text means nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.errors import ContractInvalid, InvalidInput
from ember.runtimes.llm import LLMModel, LLMRuntime, PromptCheck
from ember.runtimes.llm_tools import HERMES, LLAMA3
from ember.testing.gguf_models import CHATML_TOOLS, write_model
from ember.wire.contract import example_contracts_dir, load_contract, parse_contract

SMOLLM2 = load_contract(example_contracts_dir() / "smollm2.yaml")
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                                          "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("base") / "base.gguf", "llama", chat_template=False)


def load(gguf: Path, where: Path, store_root: Path, **options: Any) -> LLMModel:
    """The GGUF through LLMRuntime with a contract like SmolLM2's, read from `where`/model.yaml."""
    data = SMOLLM2.model_dump(mode="json", exclude={"source"})
    data.update(name="base", weights=str(gguf),
                options={**data["options"], "kv_tokens": None, "snapshots": False, **options})
    contract = parse_contract(data, source=str(where / "model.yaml"))
    return LLMRuntime(cache_root=store_root).load(contract)


def request(**fields: Any) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    return {"request": arr}


def test_without_a_template_chat_is_refused_naming_the_contract_keys(base_gguf: Path, tmp_path: Path,
                                                                    store_root: Path) -> None:
    model = load(base_gguf, tmp_path, store_root)
    assert model.engine.chat_template is None and model.template is None
    with pytest.raises(InvalidInput, match="no chat template .* options.chat_template or options.chat_template_file"):
        list(model.stream(request(messages=ASK, max_tokens=2)))
    assert len(list(model.stream(request(prompt="Once upon a time", max_tokens=2)))) == 2   # a prompt needs none


def test_the_contracts_template_serves_warmup_chat_and_tools(base_gguf: Path, tmp_path: Path,
                                                             store_root: Path) -> None:
    (tmp_path / "chatml-tools.jinja").write_text(CHATML_TOOLS)
    model = load(base_gguf, tmp_path, store_root, chat_template_file="chatml-tools.jinja")
    assert model.tool_format is HERMES
    # The warm-up: the contract's own request, a chat, as the node runs it.
    warmup = model.contract.warmup.inputs or {}
    (raw,) = warmup["request"]
    assert "messages" in json.loads(str(raw))
    assert list(model.stream(request(**json.loads(str(raw)))))
    rendered = model.render(model.request_of(request(messages=ASK)))
    assert rendered.startswith("<|im_start|>user\nWhat is the weather") and rendered.endswith("<|im_start|>assistant")
    chat = list(model.stream(request(messages=ASK, temperature=0, max_tokens=4)))
    assert len(chat) == 4 and int(chat[-1]["prompt_tokens"][0]) == len(model.prompt_ids(model.request_of(
        request(messages=ASK))))
    called = list(model.stream(request(messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
                                       max_tokens=128)))
    assert bytes(called[-1]["finish_reason"][0]) == b"tool_calls"
    (call,) = json.loads(bytes(called[-1]["tool_calls"][0]))
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Rome")
    # The gateway's check renders the same template: a chat with tools passes, a prompt too long does not.
    check = PromptCheck(model.contract)
    check(json.dumps({"messages": ASK, "tools": [WEATHER], "tool_choice": "required"}).encode())
    with pytest.raises(InvalidInput, match="^messages: prompt of"):
        check(json.dumps({"messages": [{"role": "user", "content": "word " * 3000}]}).encode())


def test_an_inline_template_and_a_named_tool_format(base_gguf: Path, tmp_path: Path, store_root: Path) -> None:
    inline = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
              "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}assistant:")
    model = load(base_gguf, tmp_path, store_root, chat_template=inline, tool_format="llama3")
    assert model.tool_format is LLAMA3
    assert model.render(model.request_of(request(messages=ASK))) == f"user: {ASK[0]['content']}\nassistant:"
    called = list(model.stream(request(messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
                                       max_tokens=128)))
    assert bytes(called[-1]["finish_reason"][0]) == b"tool_calls"


def test_a_template_file_that_is_not_there_fails_the_load_naming_the_key(base_gguf: Path, tmp_path: Path,
                                                                        store_root: Path) -> None:
    with pytest.raises(ContractInvalid, match=r"options.chat_template_file: cannot read .*nope.jinja"):
        load(base_gguf, tmp_path, store_root, chat_template_file="nope.jinja")
