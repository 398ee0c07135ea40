from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ember.errors import ContractInvalid, InvalidInput, ModelNotReady
from ember.runtimes import get_runtime
from ember.runtimes.embedding import (
    EmbeddingModel,
    EmbeddingRuntime,
    TokenLimits,
    decode_items,
    length_batches,
    pool,
    token_ids_element,
    token_limits,
)
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract, parse_contract

MINILM = load_contract(example_contracts_dir() / "minilm.yaml")
_WEIGHTS = MINILM.weights_path()
assert _WEIGHTS is not None
MODEL_DIR: Path = _WEIGHTS
SMALL_FILES = ("modules.json", "config.json", "sentence_bert_config.json", "1_Pooling/config.json")
SENTENCES = ["The cat sits on the mat.", "A quick brown fox.", "", "naïve café 日本語", "ember " * 300]


def texts(*items: str) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = [s.encode() for s in items]
    return arr


def contract_for(weights: Path | str, **patch: Any) -> ModelContract:
    data = MINILM.model_dump(exclude={"source"})
    data.update(weights=str(weights), **patch)
    return parse_contract(data)


@pytest.fixture(scope="module")
def minilm() -> EmbeddingModel:
    return EmbeddingRuntime().load(MINILM)


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    """The MiniLM directory with its small files copied (editable) and its big files linked."""
    root = tmp_path / "model"
    (root / "1_Pooling").mkdir(parents=True)
    for name in SMALL_FILES:
        shutil.copy(MODEL_DIR / name, root / name)
    for name in ("model.safetensors", "tokenizer.json"):
        (root / name).symlink_to(MODEL_DIR / name)
    return root


def edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_get_runtime_returns_the_embedding_runtime() -> None:
    assert isinstance(get_runtime("sentence-transformers"), EmbeddingRuntime)


def test_what_the_model_directory_says_is_used(minilm: EmbeddingModel) -> None:
    assert minilm.dimension == 384
    assert minilm.max_seq_length == 256  # sentence_bert_config.json, not tokenizer.json's 128
    assert minilm.normalize  # modules.json lists Normalize
    assert minilm.layout.pooling_modes == ("mean_tokens",)


def test_embeddings_are_unit_rows_with_token_counts(minilm: EmbeddingModel) -> None:
    out = minilm.infer({"text": texts(*SENTENCES)})
    assert out["embedding"].dtype == np.float32 and out["embedding"].shape == (5, 384)
    np.testing.assert_allclose(np.linalg.norm(out["embedding"], axis=1), 1.0, rtol=1e-5)
    assert out["token_count"].dtype == np.int64
    expected = [len(minilm.tokenizer.encode(s).ids) for s in SENTENCES]
    assert out["token_count"].tolist() == expected
    assert out["token_count"][2] == 2  # "" is [CLS] [SEP]
    assert out["token_count"][4] == 256  # truncated at max_seq_length


def test_batching_and_order_do_not_change_vectors(minilm: EmbeddingModel) -> None:
    together = minilm.infer({"text": texts(*SENTENCES)})["embedding"]
    one_by_one = np.stack([minilm.infer({"text": texts(s)})["embedding"][0] for s in SENTENCES])
    np.testing.assert_allclose(together, one_by_one, atol=2e-5)
    small = EmbeddingRuntime().load(contract_for(MODEL_DIR, options={"batch_size": 2}))
    np.testing.assert_allclose(small.infer({"text": texts(*SENTENCES)})["embedding"], together, atol=2e-5)


def test_similar_sentences_are_closer_than_unrelated_ones(minilm: EmbeddingModel) -> None:
    e = minilm.infer({"text": texts("A man is playing a guitar.", "Someone plays the guitar.", "Stocks fell.")})
    emb = e["embedding"]
    assert emb[0] @ emb[1] > emb[0] @ emb[2] + 0.3


def test_options_override_normalize_and_max_seq_length(minilm: EmbeddingModel) -> None:
    raw = EmbeddingRuntime().load(contract_for(MODEL_DIR, options={"normalize": False, "max_seq_length": 8}))
    out = raw.infer({"text": texts("cat " * 300, SENTENCES[0])})
    assert out["token_count"].tolist() == [8, 8]
    norms = np.linalg.norm(out["embedding"], axis=1)
    assert not np.allclose(norms, 1.0, atol=1e-3)
    truncated = minilm.infer({"text": texts("cat " * 6)})["embedding"][0]  # 6 words + [CLS] [SEP] = 8 tokens
    np.testing.assert_allclose(out["embedding"][0] / norms[0], truncated, atol=2e-5)


def test_an_empty_batch_gives_empty_outputs(minilm: EmbeddingModel) -> None:
    out = minilm.infer({"text": np.empty(0, dtype=object)})
    assert out["embedding"].shape == (0, 384) and out["token_count"].shape == (0,)


def test_token_count_is_left_out_when_the_contract_does_not_name_it() -> None:
    only = contract_for(MODEL_DIR, outputs=[{"name": "embedding", "datatype": "FP32", "shape": [-1, -1]}])
    assert set(EmbeddingRuntime().load(only).infer({"text": texts("hi")})) == {"embedding"}


def test_weights_are_mmapped_from_the_safetensors_file(minilm: EmbeddingModel) -> None:
    ptr = minilm.encoder.embeddings.word_embeddings.weight.data_ptr()
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str((MODEL_DIR / "model.safetensors").resolve())):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            spans.append((lo, hi))
    assert any(lo <= ptr < hi for lo, hi in spans), "word embeddings are not a view of the mmapped file"


def test_bad_utf8_is_invalid_input_naming_text(minilm: EmbeddingModel) -> None:
    arr = np.array([b"fine", b"caf\xe9"], dtype=object)
    with pytest.raises(InvalidInput, match=r"input 'text': element 1 is not valid UTF-8"):
        minilm.infer({"text": arr})


def test_non_bytes_elements_are_invalid_input() -> None:
    with pytest.raises(InvalidInput, match=r"input 'text': element 0 is int"):
        decode_items(np.array([3], dtype=object))
    assert decode_items(np.array(["already text"], dtype=object)) == ["already text"]


def ids_and_texts(*items: str | list[int]) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = [s.encode() if isinstance(s, str) else token_ids_element(s) for s in items]
    return arr


def test_token_ids_embed_as_the_text_they_tokenize_to(minilm: EmbeddingModel) -> None:
    """An element of token ids (the tokenizer's own output, [CLS] and [SEP] included) embeds as its text does,
    beside texts in one request; its token count is its ids'."""
    ids = minilm.tokenizer.encode(SENTENCES[0].lower()).ids
    out = minilm.infer({"text": ids_and_texts(SENTENCES[1], ids, SENTENCES[0])})
    assert np.allclose(out["embedding"][1], out["embedding"][2], atol=1e-6)
    assert int(out["token_count"][1]) == len(ids) == int(out["token_count"][2])
    alone = minilm.infer({"text": texts(SENTENCES[1])})["embedding"][0]
    assert np.allclose(out["embedding"][0], alone, atol=1e-5)


def test_token_ids_are_embedded_as_they_are(minilm: EmbeddingModel) -> None:
    """No [CLS]/[SEP] is added to ids (vLLM's rule): the bare word pieces embed otherwise than the sentence."""
    ids = minilm.tokenizer.encode(SENTENCES[0].lower()).ids
    out = minilm.infer({"text": ids_and_texts(ids, ids[1:-1])})
    assert int(out["token_count"][1]) == len(ids) - 2
    assert not np.allclose(out["embedding"][0], out["embedding"][1], atol=1e-3)


@pytest.mark.parametrize(("ids", "needle"), [
    ([101, 30522, 102], r"input 'text'\[1\]\[1\]: token id 30522 is not in the model's vocabulary \(0 to 30521\)"),
    ([101] * 257, r"input 'text'\[1\]: 257 token ids exceed the model's max_seq_length of 256"),
    ([], r"input 'text'\[1\]: must not be an empty list of token ids"),
])
def test_token_ids_outside_the_model_are_invalid_input_naming_them(minilm: EmbeddingModel, ids: list[int],
                                                                   needle: str) -> None:
    with pytest.raises(InvalidInput, match=needle):
        minilm.infer({"text": ids_and_texts("fine", ids)})


def test_token_ids_must_be_whole_uint32s() -> None:
    with pytest.raises(InvalidInput, match=r"element 0 starts with 0xFF \(token ids\) but its 3 bytes"):
        decode_items(np.array([b"\xff\x01\x02\x03"], dtype=object))
    assert decode_items(np.array([token_ids_element([7, 2**31])], dtype=object)) == [[7, 2**31]]


def test_token_limits_are_read_from_the_model_directory_without_loading_it(model_copy: Path) -> None:
    assert token_limits(MINILM) == TokenLimits(30522, 256)
    assert token_limits(contract_for(model_copy, options={"max_seq_length": 128})) == TokenLimits(30522, 128)
    assert token_limits(contract_for(model_copy / "nowhere")) is None


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"max_seq_length": 1}, "options.max_seq_length"),
        ({"max_seq_length": 1000}, "options.max_seq_length: 1000 exceeds the model's max_position_embeddings"),
        ({"batch_size": 0}, "options.batch_size"),
        ({"normalize": "sometimes"}, "options.normalize"),
        ({"colour": "red"}, "options.colour"),
    ],
)
def test_bad_options_are_contract_invalid_naming_the_key(options: dict[str, Any], key: str) -> None:
    with pytest.raises(ContractInvalid, match=f"model 'minilm:1': .*{key}"):
        EmbeddingRuntime().load(contract_for(MODEL_DIR, options=options))


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        ({"outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 128]}]}, "outputs.embedding.shape"),
        ({"outputs": [{"name": "embedding", "datatype": "FP16", "shape": [-1, 384]}]}, "outputs.embedding"),
        ({"outputs": [{"name": "vec", "datatype": "FP32", "shape": [-1, 384]}]}, "outputs: \\['vec'\\] unknown"),
        ({"inputs": [{"name": "text", "datatype": "FP32", "shape": [-1]}]}, "inputs"),
    ],
)
def test_contracts_off_the_io_conventions_are_rejected(patch: dict[str, Any], key: str) -> None:
    with pytest.raises(ContractInvalid, match=key):
        EmbeddingRuntime().load(contract_for(MODEL_DIR, **patch))


def test_missing_weights_directory_names_the_model_and_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotReady, match=r"model 'minilm:1': weights directory '.*nothing-here' does not exist"):
        EmbeddingRuntime().load(contract_for(tmp_path / "nothing-here"))


@pytest.mark.parametrize("name", ["modules.json", "config.json", "1_Pooling/config.json", "tokenizer.json",
                                  "model.safetensors"])
def test_a_missing_file_is_named(model_copy: Path, name: str) -> None:
    (model_copy / name).unlink()
    with pytest.raises(ModelNotReady, match=rf"model 'minilm:1': .*{name}: file is missing"):
        EmbeddingRuntime().load(contract_for(model_copy))


def test_corrupt_safetensors_is_named(model_copy: Path) -> None:
    target = model_copy / "model.safetensors"
    target.unlink()
    target.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelNotReady, match=r"model 'minilm:1': .*model.safetensors: not a readable safetensors"):
        EmbeddingRuntime().load(contract_for(model_copy))


def test_truncated_safetensors_is_named(model_copy: Path) -> None:
    target = model_copy / "model.safetensors"
    data = (MODEL_DIR / "model.safetensors").read_bytes()
    target.unlink()
    target.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelNotReady, match=r"model.safetensors: not a readable safetensors"):
        EmbeddingRuntime().load(contract_for(model_copy))


def test_safetensors_without_the_encoder_tensors_is_named(model_copy: Path) -> None:
    from safetensors.torch import save_file

    target = model_copy / "model.safetensors"
    target.unlink()
    save_file({"something.else": torch.zeros(2)}, str(target))
    with pytest.raises(ModelNotReady, match=r"model.safetensors: tensor 'embeddings.word_embeddings.weight'"):
        EmbeddingRuntime().load(contract_for(model_copy))


def test_bad_json_is_named(model_copy: Path) -> None:
    (model_copy / "config.json").write_text("{ not json")
    with pytest.raises(ModelNotReady, match=r"config.json: not valid JSON"):
        EmbeddingRuntime().load(contract_for(model_copy))


def test_a_bad_bert_config_key_is_named(model_copy: Path) -> None:
    edit_json(model_copy / "config.json", hidden_act="swish")
    with pytest.raises(ModelNotReady, match=r"config.json: hidden_act"):
        EmbeddingRuntime().load(contract_for(model_copy))


def test_unsupported_modules_are_named(model_copy: Path) -> None:
    modules = json.loads((model_copy / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (model_copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelNotReady, match=r"modules.json: module .*Dense.* is not supported"):
        EmbeddingRuntime().load(contract_for(model_copy))


def test_unsupported_pooling_is_named(model_copy: Path) -> None:
    edit_json(model_copy / "1_Pooling" / "config.json", pooling_mode_lasttoken=True)
    with pytest.raises(ModelNotReady, match=r"1_Pooling/config.json: pooling mode 'lasttoken'"):
        EmbeddingRuntime().load(contract_for(model_copy))


def test_the_model_files_decide_pooling_normalize_and_length(model_copy: Path) -> None:
    edit_json(model_copy / "1_Pooling" / "config.json", pooling_mode_mean_tokens=False, pooling_mode_cls_token=True,
              pooling_mode_max_tokens=True)
    edit_json(model_copy / "sentence_bert_config.json", max_seq_length=16)
    modules = [m for m in json.loads((model_copy / "modules.json").read_text()) if not m["type"].endswith("Normalize")]
    (model_copy / "modules.json").write_text(json.dumps(modules))
    contract = contract_for(model_copy, outputs=[{"name": "embedding", "datatype": "FP32", "shape": [-1, 768]},
                                                 {"name": "token_count", "datatype": "INT64", "shape": [-1]}])
    model = EmbeddingRuntime().load(contract)
    assert (model.dimension, model.max_seq_length, model.normalize) == (768, 16, False)
    out = model.infer({"text": texts("ember " * 40)})
    assert out["embedding"].shape == (1, 768) and out["token_count"].tolist() == [16]


def test_batches_are_longest_first_capped_and_split_where_padding_would_double() -> None:
    lengths = [5, 256, 9, 200, 130, 10, 12, 100, 40]
    assert length_batches(lengths, batch_size=32) == [[1, 3, 4], [7], [8, 6], [5, 2, 0]]
    assert length_batches(lengths, batch_size=2) == [[1, 3], [4, 7], [8, 6], [5, 2], [0]]
    assert length_batches([], batch_size=4) == []


def test_pooling_modes_follow_the_mask() -> None:
    hidden = torch.tensor([[[1.0, -2.0], [3.0, 4.0], [100.0, 100.0]]])  # last token is padding
    mask = torch.tensor([[1, 1, 0]])
    out = pool(hidden, mask, ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens"))
    expected = [1.0, -2.0, 3.0, 4.0, 2.0, 1.0, 4.0 / 2**0.5, 2.0 / 2**0.5]
    torch.testing.assert_close(out, torch.tensor([expected]))


def test_preload_imports_torch_and_not_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from ember.runtimes import get_runtime; runtime = get_runtime('sentence-transformers'); "
        "print('torch' in sys.modules); runtime.preload(); "
        "print(*(m in sys.modules for m in ('torch', 'tokenizers', 'transformers', 'sentence_transformers')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    # Getting the runtime is cheap (the gateway may do it); preload() brings torch, never transformers.
    assert done.stdout.split() == ["False", "True", "True", "False", "False"]
