"""The llm runtime's pure parts: request parsing, stop strings, incremental UTF-8 text, sampling, the contract."""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ember.errors import ContractInvalid, InvalidInput, ModelNotReady
from ember.runtimes import KNOWN_RUNTIMES, get_runtime, gguf_convert
from ember.runtimes.gguf_convert import hf_tensor_name, to_bf16_bits, unpermute_rope
from ember.runtimes.llm import LLMModel, LLMOptions, LLMRuntime, compile_template, pick_token
from ember.runtimes.llm_request import FIELDS, IncrementalText, Request, StopText, parse_request
from ember.wire.contract import example_contracts_dir, load_contract, parse_contract
from ember.wire.tensors import validate_inputs, warmup_inputs

SMOLLM2 = load_contract(example_contracts_dir() / "smollm2.yaml")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def parse(obj: Any) -> Request:
    return parse_request(json.dumps(obj).encode())


# --- requests ----------------------------------------------------------------------------------


def test_a_full_request_parses() -> None:
    req = parse({"messages": CHAT, "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x"})
    assert req.messages == (("system", "be brief"), ("user", "hi")) and req.prompt is None
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stop) == (7, 0.0, 0.5, 3, ("x",))
    assert req.field == "messages"
    plain = parse({"prompt": "Once upon"})
    assert plain.prompt == "Once upon" and plain.field == "prompt"
    assert (plain.max_tokens, plain.temperature, plain.top_p, plain.seed, plain.stop) == (None, 1.0, 1.0, None, ())
    assert parse({"prompt": "", "seed": -1}).seed == 2**64 - 1   # any integer seeds the 64-bit generator


@pytest.mark.parametrize(("body", "message"), [
    (b"\xff{}", "request: not valid UTF-8"),
    (b"{nope", "request: not valid JSON"),
    (b"[1, 2]", "request: must be a JSON object"),
    (b'{"prompt": "a", "n": 2}', "n: unknown field"),
    (b"{}", "messages: give either messages or prompt"),
    (b'{"prompt": "a", "messages": []}', "messages: give either messages or prompt, not both"),
    (b'{"prompt": 3}', "prompt: must be a string"),
    (b'{"messages": []}', "messages: must be a non-empty list"),
    (b'{"messages": "hi"}', "messages: must be a non-empty list"),
    (b'{"messages": ["hi"]}', "messages[0]: must be an object"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, '
     b'{"role": "tool", "content": "c"}]}', "messages[2].role: must be one of system, user, assistant"),
    (b'{"messages": [{"role": "user"}]}', "messages[0].content: must be a string"),
    (b'{"messages": [{"role": "user", "content": "a", "name": "x"}]}', "messages[0].name: unknown field"),
    (b'{"prompt": "a", "max_tokens": 0}', "max_tokens: must be at least 1"),
    (b'{"prompt": "a", "max_tokens": 1.5}', "max_tokens: must be an integer"),
    (b'{"prompt": "a", "max_tokens": true}', "max_tokens: must be an integer"),
    (b'{"prompt": "a", "temperature": 2.5}', "temperature: must be a number from 0 to 2"),
    (b'{"prompt": "a", "temperature": NaN}', "temperature: must be a number from 0 to 2"),
    (b'{"prompt": "a", "temperature": "hot"}', "temperature: must be a number from 0 to 2"),
    (b'{"prompt": "a", "top_p": 0}', "top_p: must be a number greater than 0 and at most 1"),
    (b'{"prompt": "a", "top_p": 1.01}', "top_p: must be a number greater than 0 and at most 1"),
    (b'{"prompt": "a", "seed": "x"}', "seed: must be an integer"),
    (b'{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', "stop: must be a string or a list of at most 4"),
    (b'{"prompt": "a", "stop": [1]}', "stop: must be a string or a list"),
    (b'{"prompt": "a", "stop": ["a", ""]}', "stop[1]: must be 1 to 256 characters"),
])
def test_bad_requests_name_the_field(body: bytes, message: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_request(body)
    assert str(err.value).startswith(message), str(err.value)


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8), _nested,
                     max_leaves=12)
_messages = st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]),
                                     st.sampled_from(["user", "system", "assistant", "tool", ""]) | _json,
                                     max_size=3), max_size=4)
_requests = st.dictionaries(st.sampled_from([*FIELDS, "n", ""]), _json | _messages, max_size=6)


@settings(max_examples=400, deadline=None)
@given(obj=_requests | _json)
def test_any_json_is_a_request_or_an_invalid_input_naming_a_field(obj: Any) -> None:
    try:
        req = parse(obj)
    except InvalidInput as err:
        message = str(err)
        named = [f"{key}:" for key in (*FIELDS, "request")] + [f"{key}[" for key in ("messages", "stop")]
        if isinstance(obj, dict):
            named += [f"{key}: unknown field" for key in obj]
        assert any(message.startswith(prefix) for prefix in named), message
        return
    assert (req.messages is None) != (req.prompt is None)
    assert 0 <= req.temperature <= 2 and 0 < req.top_p <= 1 and len(req.stop) <= 4
    assert req.max_tokens is None or req.max_tokens >= 1


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=64))
def test_any_bytes_are_a_request_or_an_invalid_input(raw: bytes) -> None:
    with contextlib.suppress(InvalidInput):
        parse_request(raw)


def test_the_context_bounds_max_tokens_and_the_default_is_capped() -> None:
    model = SimpleNamespace(context=8192, options=LLMOptions(default_max_tokens=512))
    assert LLMModel.budget(model, parse({"prompt": "a"}), 12) == 512       # type: ignore[arg-type]
    assert LLMModel.budget(model, parse({"prompt": "a"}), 8000) == 192     # type: ignore[arg-type]
    assert LLMModel.budget(model, parse({"prompt": "a", "max_tokens": 8180}), 12) == 8180  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"^max_tokens: 9000 exceeds the context of 8192 tokens less the "
                                           r"prompt's 12 \(at most 8180\)"):
        LLMModel.budget(model, parse({"prompt": "a", "max_tokens": 9000}), 12)  # type: ignore[arg-type]


# --- stop strings ------------------------------------------------------------------------------


def stream_cut(chunks: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool]:
    cut, out = StopText(stops), []
    for chunk in chunks:
        piece, stopped = cut.push(chunk)
        out.append(piece)
        if stopped:
            return out, True
    out.append(cut.flush())
    return out, False


def test_text_is_cut_before_a_stop_string_split_over_chunks() -> None:
    out, stopped = stream_cut(["Hel", "lo ST", "OP and more"], ("STOP",))
    assert stopped and "".join(out) == "Hello " and out[1] == "lo "   # "ST" was held back, then dropped
    out, stopped = stream_cut(["a S", "Tx"], ("STOP",))
    assert not stopped and out == ["a ", "STx", ""]                  # a false start is released
    out, stopped = stream_cut(["one\n\ntwo"], ("two", "\n\n"))
    assert stopped and out == ["one"]                                 # the first completed stop wins
    assert stream_cut(["aba"], ("b", "aba")) == stream_cut(["ab", "a"], ("b", "aba")) == (["a"], True)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=6),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=4))
def test_streamed_cutting_equals_cutting_the_whole_text(text: str, cuts: list[int], stops: list[str]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, stopped = stream_cut(chunks, tuple(stops))
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]   # the first to be completed wins
    assert "".join(out) == (text[: min(hits)[1]] if hits else text)
    assert stopped == bool(hits)


# --- incremental UTF-8 text --------------------------------------------------------------------


def byte_tokenizer() -> Tokenizer:
    """A byte-level BPE with no merges: every UTF-8 byte is one token, so characters split across tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


BYTES = byte_tokenizer()


def incremental(text: str) -> list[str]:
    decoder = IncrementalText(lambda ids: BYTES.decode(ids))
    return [decoder.push(token) for token in BYTES.encode(text).ids] + [decoder.flush()]


def test_multibyte_characters_are_never_split() -> None:
    pieces = incremental("é日🎉!")
    assert [len(p.encode()) for p in pieces] == [0, 2, 0, 0, 3, 0, 0, 0, 4, 1, 0]
    assert "".join(pieces) == "é日🎉!"


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=20))
def test_incremental_text_joins_to_the_whole_and_every_piece_is_whole(text: str) -> None:
    pieces = incremental(text)
    assert "".join(pieces) == text
    assert all(p.encode().decode() == p for p in pieces)


# --- sampling ----------------------------------------------------------------------------------


def draws(seed: int, n: int = 20, temperature: float = 1.0, top_p: float = 1.0) -> list[int]:
    logits = torch.linspace(0, 3, 500)
    generator = torch.Generator().manual_seed(seed)
    return [pick_token(logits, temperature, top_p, generator) for _ in range(n)]


def test_the_same_seed_draws_the_same_tokens_and_other_seeds_differ() -> None:
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert draws(2**64 - 1) == draws(2**64 - 1)


def test_sampling_never_touches_the_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    draws(1)
    assert torch.equal(torch.rand(3), expected)


def test_temperature_zero_and_a_tiny_top_p_are_greedy() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, 4.9])
    assert pick_token(logits, 0.0, 1.0, None) == 1
    assert set(draws(3, temperature=0.0)) == {499}
    assert set(draws(3, top_p=1e-6)) == {499}
    nucleus = set(draws(4, n=200, top_p=0.02))
    assert nucleus <= set(range(480, 500)) and len(nucleus) > 1


# --- the chat template, the converter's helpers, the contract -----------------------------------


def test_the_chat_template_renders_with_a_generation_prompt_in_a_sandbox() -> None:
    template = compile_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                                "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert template.render(messages=CHAT, add_generation_prompt=True) == "<system>be brief<user>hi<assistant>"
    with pytest.raises(SecurityError, match="unsafe"):
        compile_template("{{ ''.__class__.__mro__ }}").render()


def test_gguf_names_map_to_llama_names_and_rope_rows_are_restored() -> None:
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.0.ssm_a") is None and hf_tensor_name("rope_freqs.weight") is None
    # llama.cpp's permutation (convert_hf_to_gguf.py), undone.
    heads, w = 3, np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
    permuted = w.reshape(heads, 2, 2, 2).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rope(permuted, heads), w)


def test_bf16_rounding_matches_torch() -> None:
    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 100
    values[:3] = [0.0, -0.0, np.float32(1 + 2**-8)]   # a tie rounds to even
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(to_bf16_bits(values), expected)


def test_the_bundled_contract_follows_the_convention_and_its_warmup_is_a_real_request() -> None:
    assert "llm" in KNOWN_RUNTIMES and isinstance(get_runtime("llm"), LLMRuntime)
    assert SMOLLM2.runtime == "llm" and SMOLLM2.max_batch_size == 1
    inputs = warmup_inputs(SMOLLM2)
    validate_inputs(SMOLLM2, inputs)
    req = parse_request(bytes(inputs["request"][0]))
    assert req.messages and req.max_tokens == 4 and req.temperature == 0


def variant(**changes: Any) -> Any:
    data = SMOLLM2.model_dump(mode="json", exclude={"source"})
    data.update(changes)
    return parse_contract(data)


@pytest.mark.parametrize(("changes", "message"), [
    ({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}], "warmup": {"requests": 0}},
     "inputs: the llm runtime takes inputs request"),
    ({"outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}]}, "outputs: the llm runtime takes outputs"),
    ({"inputs": [{"name": "request", "datatype": "BYTES", "shape": [-1]}], "warmup": {"requests": 0}},
     r"inputs.request: expected BYTES \[1\], got BYTES \[-1\]"),
    ({"outputs": [*SMOLLM2.model_dump(mode="json")["outputs"], {"name": "text", "datatype": "BYTES", "shape": [1]}]},
     r"outputs: the llm runtime takes outputs .* \(and optionally cached_tokens\)"),
    ({"options": {"dtype": "float16"}}, "options.dtype"),
    ({"options": {"snapshot_encoding": "int4"}}, "options.snapshot_encoding"),
    ({"options": {"max_tokens_in_flight": 0}}, "options.max_tokens_in_flight"),
    ({"options": {"beams": 4}}, "options.beams"),
    ({"weights": "model.bin"}, "weights: the llm runtime needs a .gguf file"),
])
def test_a_contract_off_the_convention_is_refused_before_any_conversion(changes: dict[str, Any],
                                                                        message: str) -> None:
    runtime = LLMRuntime(cache_root=None)
    with pytest.raises(ContractInvalid, match=message):
        runtime.load(variant(**changes))


def test_store_weights_without_a_store_are_not_ready() -> None:
    with pytest.raises(ModelNotReady, match="this node has none configured"):
        LLMRuntime(cache_root=None).load(variant(weights="store:smollm2:1"))


# --- the conversion cache ----------------------------------------------------------------------


def fake_convert(calls: list[Path], before: Any = None) -> Any:
    def convert(gguf: Path, out: Path, dtype: str, key: str = "") -> None:
        calls.append(out)
        if before is not None:
            before()
        for name in gguf_convert.FILES:
            (out / name).write_text(f"{dtype} {key}")
    return convert


def test_a_gguf_is_converted_once_and_renamed_into_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    calls: list[Path] = []
    monkeypatch.setattr(gguf_convert, "convert", fake_convert(calls))
    first = gguf_convert.converted_dir(gguf, tmp_path / "root", "float32")
    assert first.parent == tmp_path / "root" / "converted" and first.name.startswith("m-")
    assert gguf_convert.converted_dir(gguf, tmp_path / "root", "float32") == first and len(calls) == 1
    assert not calls[0].exists() and sorted(p.name for p in first.parent.iterdir()) == [first.name]
    other = gguf_convert.converted_dir(gguf, tmp_path / "root", "bfloat16")
    assert other != first and len(calls) == 2                  # another dtype, another entry
    gguf.write_bytes(b"GGUF" + bytes(101))                     # a changed file converts again
    assert gguf_convert.converted_dir(gguf, tmp_path / "root", "float32") not in (first, other)


def test_a_loader_that_loses_the_race_keeps_the_winners_copy(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    target = tmp_path / "converted" / gguf_convert.cache_key(gguf, "float32")

    def winner_finishes_first() -> None:
        target.mkdir(parents=True)
        for name in gguf_convert.FILES:
            (target / name).write_text("winner")

    calls: list[Path] = []
    monkeypatch.setattr(gguf_convert, "convert", fake_convert(calls, winner_finishes_first))
    assert gguf_convert.converted_dir(gguf, tmp_path, "float32") == target
    assert (target / "config.json").read_text() == "winner" and not calls[0].exists()
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_a_file_that_is_not_gguf_is_not_ready(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelNotReady, match="not a readable GGUF file"):
        gguf_convert.converted_dir(bad, tmp_path, "float32")
    assert [p.name for p in (tmp_path / "converted").iterdir()] == []   # no half-written entry left


def test_the_contracts_max_tokens_caps_the_request() -> None:
    assert parse_request(b'{"prompt": "a", "max_tokens": 8}', max_tokens=8).max_tokens == 8
    with pytest.raises(InvalidInput, match=r"^max_tokens: 9 exceeds the limit of 8 \(the contract's limits"):
        parse_request(b'{"prompt": "a", "max_tokens": 9}', max_tokens=8)
