"""The contract's chat template (options.chat_template, options.chat_template_file, options.tool_format): read,
checked and named by its key once, when the model loads; the tool format it teaches, or the one the contract
names. The runtimes' use of it on a real GGUF is in tests/integration/runtimes/test_llm_chat_template.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ember.errors import ContractInvalid
from ember.runtimes import parse_options
from ember.runtimes.llm import LLMOptions
from ember.runtimes.llm_template import TemplateOptions, contract_template, template_tool_format
from ember.runtimes.llm_tools import HERMES, JSON, MISTRAL
from ember.runtimes.vllm import VLLMOptions
from ember.testing.gguf_models import CHATML_TOOLS
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract, parse_contract

SMOLLM2 = load_contract(example_contracts_dir() / "smollm2.yaml")


def contract(source: Path | None = None, **options: Any) -> ModelContract:
    data = SMOLLM2.model_dump(mode="json", exclude={"source"})
    data["options"] = options
    return parse_contract(data, source=str(source) if source is not None else None)


def template_of(c: ModelContract) -> str | None:
    return contract_template(c, parse_options(c, LLMOptions))


def test_both_runtimes_take_the_template_keys() -> None:
    for options in (LLMOptions, VLLMOptions):
        parsed = options.model_validate({"chat_template": "{{ messages }}", "tool_format": "hermes"})
        assert isinstance(parsed, TemplateOptions) and parsed.chat_template == "{{ messages }}"


def test_an_inline_template_is_the_models() -> None:
    assert template_of(contract(chat_template=CHATML_TOOLS)) == CHATML_TOOLS
    assert template_of(contract()) is None   # none given: the model's own is used


def test_a_template_file_is_read_beside_the_contract(tmp_path: Path) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "chat.jinja").write_text(CHATML_TOOLS)
    beside = contract(tmp_path / "model.yaml", chat_template_file="templates/chat.jinja")
    assert template_of(beside) == CHATML_TOOLS
    absolute = contract(None, chat_template_file=str(tmp_path / "templates" / "chat.jinja"))
    assert template_of(absolute) == CHATML_TOOLS


@pytest.mark.parametrize(("options", "files", "key", "says"), [
    ({"chat_template": "{{ x }}", "chat_template_file": "t.jinja"}, {"t.jinja": "{{ x }}"},
     "options.chat_template and options.chat_template_file", "not both"),
    ({"chat_template_file": "missing.jinja"}, {}, "options.chat_template_file", "missing.jinja"),
    ({"chat_template_file": "empty.jinja"}, {"empty.jinja": "  \n"}, "options.chat_template_file", "is empty"),
    ({"chat_template_file": "latin1.jinja"}, {"latin1.jinja": b"caf\xe9"}, "options.chat_template_file",
     "not UTF-8"),
    ({"chat_template_file": "bad.jinja"}, {"bad.jinja": "{% for m in messages %}"}, "options.chat_template_file",
     "not a valid jinja2 template"),
    ({"chat_template": "{{ messages "}, {}, "options.chat_template", "not a valid jinja2 template"),
])
def test_a_bad_template_is_refused_naming_its_key(tmp_path: Path, options: dict[str, str],
                                                  files: dict[str, str | bytes], key: str, says: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ContractInvalid, match=says) as err:
        template_of(contract(tmp_path / "model.yaml", **options))
    assert f"model 'smollm2:1': {key}" in err.value.message


def test_a_relative_file_needs_a_contract_read_from_a_file() -> None:
    with pytest.raises(ContractInvalid, match="options.chat_template_file: 'chat.jinja' is relative"):
        template_of(contract(None, chat_template_file="chat.jinja"))


@pytest.mark.parametrize(("options", "bad"), [
    ({"chat_template": ""}, "options.chat_template"),
    ({"tool_format": "xml"}, "options.tool_format"),
    ({"chat_template_file": 3}, "options.chat_template_file"),
])
def test_bad_values_name_the_key(options: dict[str, Any], bad: str) -> None:
    with pytest.raises(ContractInvalid, match=bad):
        parse_options(contract(**options), LLMOptions)


def test_the_tool_format_is_the_templates_unless_the_contract_names_one() -> None:
    auto = TemplateOptions()
    assert template_tool_format(auto, CHATML_TOOLS) is HERMES
    assert template_tool_format(auto, "{{ messages }}") is None and template_tool_format(auto, None) is None
    assert template_tool_format(TemplateOptions(tool_format="mistral"), CHATML_TOOLS) is MISTRAL
    assert template_tool_format(TemplateOptions(tool_format="json"), None) is JSON
    assert template_tool_format(TemplateOptions(tool_format="none"), CHATML_TOOLS) is None


class _Tokenizer:
    """What VLLMModel reads of a Hugging Face tokenizer at construction."""

    chat_template: str | None = None
    all_special_ids: list[int] = []

    def __len__(self) -> int:
        return 100

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1, 2]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "x"


def test_the_vllm_runtime_renders_with_the_contracts_template() -> None:
    from types import SimpleNamespace

    from ember.runtimes.vllm import VLLMModel

    def engine(tokenizer: _Tokenizer) -> Any:
        return SimpleNamespace(get_tokenizer=lambda: tokenizer, model_config=SimpleNamespace(max_model_len=64),
                               vllm_config=SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=False)))

    c = contract(chat_template=CHATML_TOOLS)
    options = parse_options(c, VLLMOptions)
    tokenizer = _Tokenizer()
    model = VLLMModel(c, engine(tokenizer), options, template=contract_template(c, options))
    assert tokenizer.chat_template == CHATML_TOOLS and model.tool_format is HERMES   # what apply_chat_template uses
    plain = _Tokenizer()
    model = VLLMModel(contract(), engine(plain), parse_options(contract(), VLLMOptions))
    assert plain.chat_template is None and model.tool_format is None
