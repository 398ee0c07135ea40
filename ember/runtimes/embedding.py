"""The `sentence-transformers` runtime: sentence embeddings from a sentence-transformers model directory.

Serves BERT-family sentence-transformers models (all-MiniLM-L6-v2 is the bundled example) without
importing `transformers` or `sentence_transformers`: a plain-torch BERT encoder (ember.runtimes.bert),
the `tokenizers` library, and the pooling/normalisation the model directory describes. Vectors match
`SentenceTransformer(dir).encode(...)` (cosine >= 0.9999; tests/integration/runtimes).

Model directory (`weights`, resolved by `ModelContract.weights_path()`, or `store:NAME[:VERSION]`: its files
materialized by the node's weight store and its tensors mapped from the store's chunks), read at load time:
  modules.json                 the pipeline: Transformer (path ""), Pooling, optional Normalize
  config.json                  the BERT config; model.safetensors its weights (mmapped, not copied)
  tokenizer.json               the fast tokenizer; sentence_bert_config.json: max_seq_length, do_lower_case
  <pooling path>/config.json   pooling modes (cls / mean / max / mean_sqrt_len) and the dimension

Contract I/O conventions (the gateway relies on them):
  input  `text`         BYTES [-1]     utf-8 sentences, one per element; or token ids: an element that starts
                                       with the byte 0xFF (never in UTF-8) holds little-endian uint32 ids of the
                                       model's vocabulary after it, embedded as they are (no [CLS]/[SEP] added,
                                       not truncated: at most max_seq_length of them)
  output `embedding`    FP32  [-1, D]  one row per sentence (D = pooled dimension, 384 for MiniLM)
  output `token_count`  INT64 [-1]     tokens per sentence after truncation, special tokens included
                                       (OpenAI `usage`); optional: returned when the contract names it
Contract `options` (all optional, validated here; errors name `options.<key>`):
  normalize       bool   L2-normalise embeddings (default: whether modules.json has a Normalize module)
  max_seq_length  int    truncate sentences to this many tokens (default: sentence_bert_config.json;
                         at most the model's max_position_embeddings)
  batch_size      int    sentences per forward pass (default 32); each batch is padded to its longest

Errors: missing or unreadable model files -> ModelNotReady naming the model and the file; bad options
or a contract whose inputs/outputs do not follow the conventions -> ContractInvalid naming the key;
an input element that is not valid UTF-8, or token ids outside the vocabulary or longer than max_seq_length
-> InvalidInput naming the input `text` and the element.

Fork safety: `preload()` only imports; `load()` reads files and assigns mmapped tensors, doing no tensor
math, so neither starts torch's intra-op (OpenMP) thread pool, and a zygote or template that ran them
can fork children that then run inference. Thread counts are the process layer's business.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ember.errors import Cancelled, ContractInvalid, EmberError, InvalidInput, ModelNotReady
from ember.runtimes import parse_options
from ember.runtimes.weights import local_weights, store_files, store_tensors
from ember.wire.contract import ModelContract

if TYPE_CHECKING:  # torch and tokenizers are imported by preload()/load(), never by importing this module
    import torch
    from tokenizers import Tokenizer

    from ember.runtimes import StopCheck
    from ember.runtimes.bert import BertConfig, BertEncoder
    from ember.store import WeightStore

# Pooling modes in the order sentence-transformers concatenates them.
_POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens")
_UNSUPPORTED_POOLING = ("weightedmean_tokens", "lasttoken")
_MODULE_KINDS = ("Transformer", "Pooling", "Normalize")
TOKEN_IDS = b"\xff"   # leads an element of `text` that holds token ids (a byte UTF-8 never has)
MAX_TOKEN_ID = 2**31 - 1


class EmbeddingOptions(BaseModel):
    """The contract's `options` for this runtime."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    normalize: bool | None = None
    max_seq_length: int | None = Field(default=None, ge=2, le=65_536)
    batch_size: int = Field(default=32, ge=1, le=4096)


@dataclass(frozen=True)
class SentenceLayout:
    """What the model directory's sentence-transformers files say."""

    encoder_dir: Path
    pooling_modes: tuple[str, ...]
    pooled_from: int  # the token-state width the pooling config expects
    normalize: bool
    max_seq_length: int | None
    lower_case: bool

    @property
    def dimension(self) -> int:
        return self.pooled_from * len(self.pooling_modes)


class EmbeddingRuntime:
    """Loads sentence-transformers model directories into `EmbeddingModel`s."""

    name = "sentence-transformers"

    def preload(self) -> None:
        # Heavy imports only: no tensor is created, so no thread pool starts before the zygote forks.
        import safetensors.torch  # noqa: F401
        import tokenizers  # noqa: F401
        import torch.nn.functional  # noqa: F401

        import ember.runtimes.bert  # noqa: F401

    def load(self, contract: ModelContract, store: WeightStore | None = None) -> EmbeddingModel:
        """Load the model directory `weights` names; a store-backed one from `store` (the node's weight store)."""
        options = parse_options(contract, EmbeddingOptions)
        root = store_files(contract, store) if contract.store_ref is not None else _model_dir(contract)
        where = f"model '{contract.key}'"
        layout = read_layout(root, where)
        from ember.runtimes.bert import BertConfig

        config_path = layout.encoder_dir / "config.json"
        try:
            config = BertConfig.parse(_read_json(config_path, where))
        except ValueError as err:
            raise ModelNotReady(f"{where}: {config_path}: {err}") from None
        if layout.pooled_from != config.hidden_size:
            raise ModelNotReady(
                f"{where}: pooling word_embedding_dimension {layout.pooled_from} != hidden_size {config.hidden_size}"
            )
        max_len = max_length(options, layout, config.max_position_embeddings)
        if max_len > config.max_position_embeddings:
            raise ContractInvalid(
                f"{where}: options.max_seq_length: {max_len} exceeds the model's "
                f"max_position_embeddings ({config.max_position_embeddings})"
            )
        _check_io(contract, layout.dimension)
        normalize = layout.normalize if options.normalize is None else options.normalize
        weights_file = layout.encoder_dir / "model.safetensors"
        if contract.store_ref is not None:
            tensors = store_tensors(contract, store, weights_file.relative_to(root).as_posix())
            encoder = _build_encoder(config, tensors, f"{where}: {contract.weights}")
        else:
            encoder = _load_encoder(weights_file, config, where)
        tokenizer = _load_tokenizer(layout.encoder_dir / "tokenizer.json", max_len, where)
        return EmbeddingModel(contract, encoder, tokenizer, layout, normalize, max_len, options.batch_size)


def max_length(options: EmbeddingOptions, layout: SentenceLayout, positions: int) -> int:
    """The tokens a sentence is embedded with at most: the contract's option, else the model directory's."""
    return options.max_seq_length or layout.max_seq_length or positions


@dataclass(frozen=True)
class TokenLimits:
    """What token ids a model embeds: ids below `vocab`, at most `max_len` of them per input."""

    vocab: int
    max_len: int

    def check(self, ids: Sequence[int], where: str) -> None:
        """InvalidInput naming `where` (its `[j]` for one id) unless the ids can be embedded as they are."""
        check_token_ids(ids, where, self.vocab, self.max_len)


def check_token_ids(ids: Sequence[int], where: str, vocab: int | None = None, max_len: int | None = None) -> None:
    """Token ids within the vocabulary (`vocab` None: unknown here, ids only within uint32's range) and at most
    `max_len` of them; else InvalidInput naming `where` (an id as `where[j]`)."""
    if not len(ids):
        raise InvalidInput(f"{where}: must not be an empty list of token ids")
    if max_len is not None and len(ids) > max_len:
        raise InvalidInput(f"{where}: {len(ids)} token ids exceed the model's max_seq_length of {max_len} "
                           "(token ids are embedded as they are, not truncated)")
    top = MAX_TOKEN_ID if vocab is None else vocab - 1
    known = f"in the model's vocabulary (0 to {top})" if vocab is not None else f"one (0 to {top})"
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except OverflowError:   # past int64 (JSON numbers have no bound): no token id
        j = next(j for j, t in enumerate(ids) if not -(2**63) <= t < 2**63)
        raise InvalidInput(f"{where}[{j}]: token id {str(ids[j])[:40]} is not {known}") from None
    bad = np.flatnonzero((arr < 0) | (arr > top))
    if len(bad):
        j = int(bad[0])
        raise InvalidInput(f"{where}[{j}]: token id {int(arr[j])} is not {known}")


def token_ids_element(ids: Sequence[int]) -> bytes:
    """Token ids as one element of the `text` input (see the module docstring); ids already checked."""
    return TOKEN_IDS + np.asarray(ids, dtype="<u4").tobytes()


def token_limits(contract: ModelContract) -> TokenLimits | None:
    """A model's token-id limits from its model directory's JSON files alone (no torch): None where they cannot
    be read here (a `store:` model, files missing), the instance then checks."""
    if contract.store_ref is not None:
        return None
    try:
        options = parse_options(contract, EmbeddingOptions)
        layout = read_layout(_model_dir(contract), f"model '{contract.key}'")
        config = _read_json(layout.encoder_dir / "config.json", f"model '{contract.key}'")
        vocab, positions = config["vocab_size"], config.get("max_position_embeddings", 512)
    except (EmberError, OSError, KeyError, TypeError):
        return None
    if not isinstance(vocab, int) or not isinstance(positions, int):
        return None
    return TokenLimits(vocab, min(max_length(options, layout, positions), positions))


class EmbeddingModel:
    """A loaded sentence embedder: `infer({"text": ...}) -> {"embedding": ..., "token_count": ...}`."""

    def __init__(
        self,
        contract: ModelContract,
        encoder: BertEncoder,
        tokenizer: Tokenizer,
        layout: SentenceLayout,
        normalize: bool,
        max_seq_length: int,
        batch_size: int,
    ) -> None:
        self.contract = contract
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.layout = layout
        self.normalize = normalize
        self.max_seq_length = max_seq_length
        self.batch_size = batch_size
        self.dimension = layout.dimension
        self.pad_id = int(encoder.config.pad_token_id)
        self.limits = TokenLimits(int(encoder.config.vocab_size), max_seq_length)
        self._wants_count = any(spec.name == "token_count" for spec in contract.outputs)

    def infer(self, inputs: Mapping[str, np.ndarray], stop: StopCheck | None = None) -> dict[str, np.ndarray]:
        if "text" not in inputs:
            raise InvalidInput(f"input 'text': missing (model '{self.contract.name}' requires it)")
        ids = self.token_ids(decode_items(inputs["text"]))
        counts = np.array([len(row) for row in ids], dtype=np.int64)
        out: dict[str, np.ndarray] = {"embedding": self.embed(ids, stop)}
        if self._wants_count:
            out["token_count"] = counts
        return out

    def token_ids(self, items: list[str | list[int]]) -> list[list[int]]:
        """Each element's token ids: a text tokenized (truncated to max_seq_length), token ids checked and kept."""
        texts = [(i, t.lower() if self.layout.lower_case else t) for i, t in enumerate(items) if isinstance(t, str)]
        encoded = self.tokenizer.encode_batch([t for _, t in texts]) if texts else []
        out: list[list[int]] = [[] for _ in items]
        for (i, _), encoding in zip(texts, encoded, strict=True):
            out[i] = encoding.ids
        for i, item in enumerate(items):
            if not isinstance(item, str):
                self.limits.check(item, f"input 'text'[{i}]")
                out[i] = item
        return out

    def embed(self, ids: list[list[int]], stop: StopCheck | None = None) -> np.ndarray:
        """Token id lists -> FP32 [n, D] embeddings (row order kept); `stop` is checked between forward passes."""
        import torch

        out = np.zeros((len(ids), self.dimension), dtype=np.float32)
        with torch.inference_mode():
            for chunk in length_batches([len(row) for row in ids], self.batch_size):
                if stop is not None and stop():
                    raise Cancelled(f"model '{self.contract.key}': stopped after {len(ids)} sentences were queued")
                out[chunk] = self._forward([ids[i] for i in chunk]).numpy()
        return out

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        width = max(len(r) for r in rows)
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        mask_t = torch.from_numpy(mask)
        hidden = self.encoder(torch.from_numpy(input_ids), mask_t)
        pooled = pool(hidden, mask_t, self.layout.pooling_modes)
        return F.normalize(pooled, p=2.0, dim=1) if self.normalize else pooled


def length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped longest first into batches of at most `batch_size`.

    A batch also ends before a sentence that padding would more than double (plus a 16-token slack, as
    short rows cost little): every batch is padded to its longest, and one 256-token sentence would
    otherwise make 31 short ones cost 256 tokens each.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if not batches or len(batches[-1]) == batch_size or lengths[batches[-1][0]] > 2 * lengths[i] + 16:
            batches.append([])
        batches[-1].append(i)
    return batches


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """Token states [B, L, H] and mask [B, L] -> sentence vectors [B, H * len(modes)]."""
    import torch

    m = mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * m).sum(dim=1)
    lengths = m.sum(dim=1).clamp(min=1e-9)
    parts = []
    for mode in modes:
        if mode == "cls_token":
            parts.append(hidden[:, 0])
        elif mode == "max_tokens":
            parts.append(hidden.masked_fill(m == 0, -1e9).max(dim=1).values)
        elif mode == "mean_tokens":
            parts.append(summed / lengths)
        else:  # mean_sqrt_len_tokens
            parts.append(summed / torch.sqrt(lengths))
    return torch.cat(parts, dim=1)


def decode_items(array: np.ndarray) -> list[str | list[int]]:
    """A BYTES tensor of utf-8 sentences or token ids (see the module docstring) -> a str or an id list each;
    InvalidInput names `text` and the element."""
    texts: list[str | list[int]] = []
    for i, item in enumerate(np.asarray(array, dtype=object).reshape(-1)):
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, bytes | bytearray | np.bytes_) and bytes(item[:1]) == TOKEN_IDS:
            texts.append(_token_ids(bytes(item), i))
        elif isinstance(item, bytes | bytearray | np.bytes_):
            try:
                texts.append(bytes(item).decode("utf-8"))
            except UnicodeDecodeError as err:
                raise InvalidInput(
                    f"input 'text': element {i} is not valid UTF-8 ({err.reason} at byte {err.start})"
                ) from None
        else:
            raise InvalidInput(f"input 'text': element {i} is {type(item).__name__}, expected utf-8 bytes")
    return texts


def _token_ids(item: bytes, i: int) -> list[int]:
    if (len(item) - 1) % 4:
        raise InvalidInput(f"input 'text': element {i} starts with 0xFF (token ids) but its {len(item) - 1} bytes "
                           "after it are not whole little-endian uint32 ids")
    ids: list[int] = np.frombuffer(item, dtype="<u4", offset=1).tolist()
    return ids


def read_layout(root: Path, where: str) -> SentenceLayout:
    """Read modules.json, the pooling config and sentence_bert_config.json; errors name the file."""
    modules_path = root / "modules.json"
    modules = _read_json(modules_path, where)
    if not isinstance(modules, list):
        raise ModelNotReady(f"{where}: {modules_path}: expected a list of modules")
    by_kind: dict[str, str] = {}
    for entry in modules:
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1] if isinstance(entry, dict) else ""
        if kind not in _MODULE_KINDS:
            raise ModelNotReady(
                f"{where}: {modules_path}: module {entry!r} is not supported (supported: {', '.join(_MODULE_KINDS)})"
            )
        by_kind[kind] = str(entry.get("path", ""))
    for kind in ("Transformer", "Pooling"):
        if kind not in by_kind:
            raise ModelNotReady(f"{where}: {modules_path}: no {kind} module")
    encoder_dir = root / by_kind["Transformer"]
    modes, width = _read_pooling(root / by_kind["Pooling"] / "config.json", where)
    sbert_path = encoder_dir / "sentence_bert_config.json"
    sbert = _read_json(sbert_path, where) if sbert_path.exists() else {}
    max_len = sbert.get("max_seq_length")
    if max_len is not None and (not isinstance(max_len, int) or max_len < 2):
        raise ModelNotReady(f"{where}: {sbert_path}: max_seq_length must be an integer >= 2, got {max_len!r}")
    return SentenceLayout(
        encoder_dir=encoder_dir,
        pooling_modes=modes,
        pooled_from=width,
        normalize="Normalize" in by_kind,
        max_seq_length=max_len,
        lower_case=bool(sbert.get("do_lower_case", False)),
    )


def _read_pooling(path: Path, where: str) -> tuple[tuple[str, ...], int]:
    config = _read_json(path, where)
    if not isinstance(config, dict):
        raise ModelNotReady(f"{where}: {path}: expected a mapping")
    for mode in _UNSUPPORTED_POOLING:
        if config.get(f"pooling_mode_{mode}"):
            raise ModelNotReady(f"{where}: {path}: pooling mode {mode!r} is not supported")
    modes = tuple(m for m in _POOLING_MODES if config.get(f"pooling_mode_{m}"))
    width = config.get("word_embedding_dimension")
    if not modes:
        raise ModelNotReady(f"{where}: {path}: no pooling mode is enabled")
    if not isinstance(width, int) or width <= 0:
        raise ModelNotReady(f"{where}: {path}: word_embedding_dimension must be a positive integer")
    return modes, width


def _read_json(path: Path, where: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelNotReady(f"{where}: {path}: file is missing") from None
    except OSError as err:
        raise ModelNotReady(f"{where}: {path}: cannot read: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelNotReady(f"{where}: {path}: not valid JSON: {err}") from None


def _load_encoder(path: Path, config: BertConfig, where: str) -> BertEncoder:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise ModelNotReady(f"{where}: {path}: file is missing")
    try:
        # safe_open mmaps the file: the tensors are views of the page cache, shared by forked children.
        with safe_open(str(path), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelNotReady(f"{where}: {path}: not a readable safetensors file: {err}") from None
    return _build_encoder(config, tensors, f"{where}: {path}")


def _build_encoder(config: BertConfig, tensors: dict[str, torch.Tensor], where: str) -> BertEncoder:
    from ember.runtimes.bert import build_encoder

    try:
        return build_encoder(config, tensors)
    except ValueError as err:
        raise ModelNotReady(f"{where}: {err}") from None


def _load_tokenizer(path: Path, max_seq_length: int, where: str) -> Tokenizer:
    from tokenizers import Tokenizer

    if not path.is_file():
        raise ModelNotReady(f"{where}: {path}: file is missing")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises plain Exception on a bad file
        raise ModelNotReady(f"{where}: {path}: not a readable tokenizer: {err}") from None
    # Padding is done per batch by EmbeddingModel; truncation counts [CLS]/[SEP] like sentence-transformers.
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_seq_length)
    return tokenizer


def _model_dir(contract: ModelContract) -> Path:
    root = local_weights(contract)
    if root is None:
        raise ContractInvalid(f"model '{contract.key}': weights: the sentence-transformers runtime needs a model dir")
    if not root.is_dir():
        raise ModelNotReady(f"model '{contract.key}': weights directory {str(root)!r} does not exist")
    return root


def _check_io(contract: ModelContract, dimension: int) -> None:
    """The contract's tensors must follow this runtime's conventions (see the module docstring)."""
    where = f"model '{contract.key}'"
    text = contract.input("text")
    if text is None or len(contract.inputs) != 1 or text.datatype != "BYTES" or len(text.shape) != 1:
        raise ContractInvalid(f"{where}: inputs: the sentence-transformers runtime takes one input 'text' BYTES [-1]")
    outputs = {spec.name: spec for spec in contract.outputs}
    unknown = set(outputs) - {"embedding", "token_count"}
    if unknown:
        raise ContractInvalid(f"{where}: outputs: {sorted(unknown)} unknown (expected embedding, token_count)")
    embedding = outputs.get("embedding")
    if embedding is None or embedding.datatype != "FP32" or len(embedding.shape) != 2:
        raise ContractInvalid(f"{where}: outputs.embedding: expected FP32 [-1, {dimension}]")
    if embedding.shape[1] not in (-1, dimension):
        raise ContractInvalid(
            f"{where}: outputs.embedding.shape: the model's dimension is {dimension}, not {embedding.shape[1]}"
        )
    count = outputs.get("token_count")
    if count is not None and (count.datatype != "INT64" or len(count.shape) != 1):
        raise ContractInvalid(f"{where}: outputs.token_count: expected INT64 [-1]")
