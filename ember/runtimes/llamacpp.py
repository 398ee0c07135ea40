"""llama.cpp behind the engine seam (ember.runtimes.llm_engine), through llama-cpp-python's low-level API.

The GGUF is mapped as it is (no de-quantising): its pages are the page cache's, shared by every process that
maps the file and by every instance forked from a template. Every architecture llama.cpp supports is served.
A context holds one KV pool of `kv_tokens` cells shared by `slots` sequences (`kv_unified`: a sequence may use
any free cell, so one long prompt and many short ones fit the same pool); the scheduler counts what each
sequence can reach against it, so a step never runs out of cells.

Fork safety: `load` maps the file and reads the vocabulary (no thread); llama.cpp's CPU backend computes on
`n_threads` threads and starts none for one, so a template may compute on one thread and fork; an instance
calls `set_threads` after the fork. Weights are not repacked into anonymous memory (`use_extra_bufts` off by
default: repacked copies would be private to each process that loads them, where mapped pages are shared).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import numpy as np

from ember.errors import InvalidInput, ModelFailed, ModelNotReady
from ember.runtimes import ggml_backends
from ember.runtimes.llm_engine import ECHO_OUTPUTS, Feed

log = logging.getLogger("ember.llm")

KV_TYPES = {"f16": 1, "q8_0": 8, "f32": 0}   # ggml type ids (GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_F32)
_LOG_CALLBACK: Any = None   # the ctypes callback must outlive every llama.cpp call that may log


def _lib() -> Any:
    """llama_cpp's low-level module, its log routed to ours (warnings and errors only) and its backend up."""
    global _LOG_CALLBACK
    import llama_cpp

    if _LOG_CALLBACK is None:
        def on_log(level: int, text: bytes | None, _: Any) -> None:
            if level in (3, 4) and text:   # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
                log.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

        _LOG_CALLBACK = llama_cpp.llama_log_callback(on_log)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        ggml_backends.load()   # this CPU's kernels, before the backend starts
        llama_cpp.llama_backend_init()
    return llama_cpp


def preload() -> None:
    """Import llama-cpp-python and load libllama (a zygote's import: maps the library, starts no thread)."""
    _lib()


class LlamaCppModel:
    """A GGUF mapped by llama.cpp: tokenizer, chat template, and contexts opened on it."""

    name = "llama.cpp"

    def __init__(self, path: Path, *, repack: bool = False, vocab_only: bool = False) -> None:
        lib = _lib()
        self.lib, self.path, self.repack = lib, path, repack
        params = lib.llama_model_default_params()
        params.load_mode = lib.LLAMA_LOAD_MODE_MMAP   # mapped as it is, never read into private memory
        params.n_gpu_layers = 0
        params.use_extra_bufts = repack
        params.vocab_only = vocab_only   # the tokenizer and hyper-parameters only: no weights, no context
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ModelNotReady(f"weights: llama.cpp could not load {str(path)!r} (see the log for why: an "
                                "architecture it does not know, or a damaged file)")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self.vocab))
        self.architecture = self.meta("general.architecture") or "unknown"
        self.context_length = int(self.meta(f"{self.architecture}.context_length") or 0) if vocab_only else \
            int(lib.llama_model_n_ctx_train(self.model))
        self.eos = frozenset(t for t in range(self.vocab_size) if lib.llama_vocab_is_eog(self.vocab, t))
        bos = int(lib.llama_vocab_bos(self.vocab))
        self.bos = bos if bos >= 0 else None
        self.add_bos = bool(lib.llama_vocab_get_add_bos(self.vocab)) and self.bos is not None
        template = lib.llama_model_chat_template(self.model, None)
        self.chat_template = template.decode("utf-8") if template else None
        # With the vocabulary only, llama.cpp has no per-layer hyper-parameters (asking aborts): no KV figures.
        self.kv_bytes_per_token = 0 if vocab_only else self._kv_bytes(2)
        # Sliding-window and recurrent models cannot cut a sequence back to a shorter prefix and carry on
        # exactly (the window's positions are gone): their prefix cache reuses whole entries only.
        self.can_cut = vocab_only or not (lib.llama_model_n_swa(self.model) > 0 or
                                          lib.llama_model_is_recurrent(self.model) or
                                          lib.llama_model_is_hybrid(self.model))
        self._pieces: dict[int, bytes] = {}

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self.lib.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _kv_bytes(self, element: float) -> int:
        """KV bytes per token at `element` bytes per value: layers x (key + value widths)."""
        arch = self.architecture
        heads = int(self.lib.llama_model_n_head(self.model)) or 1
        kv_heads = int(self.lib.llama_model_n_head_kv(self.model)) or heads
        head = int(self.lib.llama_model_n_embd(self.model)) // heads
        key = int(self.meta(f"{arch}.attention.key_length") or head)
        value = int(self.meta(f"{arch}.attention.value_length") or head)
        return int(self.lib.llama_model_n_layer(self.model) * kv_heads * (key + value) * element)

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        raw = text.encode("utf-8")
        room = len(raw) + 8
        out = (self.lib.llama_token * room)()
        n = self.lib.llama_tokenize(self.vocab, raw, len(raw), out, room, False, special)
        if n < 0:   # more tokens than bytes + 8 cannot happen for byte-level vocabularies; be safe
            room = -n
            out = (self.lib.llama_token * room)()
            n = self.lib.llama_tokenize(self.vocab, raw, len(raw), out, room, False, special)
        return list(out[:n])

    def piece(self, token: int) -> bytes:
        found = self._pieces.get(token)
        if found is None:
            buf = ctypes.create_string_buffer(256)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            found = buf.raw[: max(n, 0)]
            self._pieces[token] = found
        return found

    def token_text(self, token: int) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")

    def grammar(self, gbnf: str) -> LlamaCppGrammar:
        return LlamaCppGrammar(self, gbnf)

    def open(self, slots: int, kv_tokens: int, *, threads: int = 1, kv_type: str = "f16",
             step_tokens: int = 512) -> LlamaCppContext:
        return LlamaCppContext(self, slots, kv_tokens, threads, kv_type, step_tokens)

    def close(self) -> None:
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None


class LlamaCppContext:
    """One llama.cpp context: a unified KV pool for `slots` sequences, stepped with one batch at a time."""

    def __init__(self, model: LlamaCppModel, slots: int, kv_tokens: int, threads: int, kv_type: str,
                 step_tokens: int) -> None:
        self.lib, self.model, self.slots = model.lib, model, slots
        self.can_cut, self.threads, self.kv_type = model.can_cut, threads, kv_type
        self.outputs_max = slots + ECHO_OUTPUTS
        self.step_tokens = step_tokens
        self._open(kv_tokens)

    def _open(self, kv_tokens: int) -> None:
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = kv_tokens
        params.n_batch = params.n_ubatch = self.step_tokens
        params.n_seq_max = self.slots
        params.n_outputs_max = self.outputs_max           # one per decoding sequence, plus a prompt's own
        params.n_outputs_max_per_seq = ECHO_OUTPUTS       # (completions' echo with logprobs), chunk by chunk
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = True
        params.no_perf = True
        params.type_k = params.type_v = KV_TYPES[self.kv_type]
        if self.kv_type != "f16":   # a quantised V cache needs flash attention in llama.cpp
            params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = lib.llama_init_from_model(self.model.model, params)
        if not self.ctx:
            raise ModelNotReady(f"llama.cpp could not open a context of {kv_tokens} tokens for {self.slots} "
                                f"sequences ({self.kv_type} KV; see the log)")
        self.kv_tokens = kv_tokens
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(self.step_tokens, 0, 1)

    def grow(self, kv_tokens: int, live: list[int]) -> None:
        """A new context of `kv_tokens` cells, the `live` sequences' KV moved into it. The old one goes first (the
        two pools never exist at once; the live sequences' saved KV does, beside the new one); if the new one
        cannot be made, the old size comes back with their KV (ModelNotReady). A context that cannot be made
        again at its old size either is lost (ModelFailed; every later step fails the same way)."""
        states = {seq: self.save(seq) for seq in live if self.lib.llama_memory_seq_pos_max(self.memory, seq) >= 0}
        old = self.kv_tokens
        self.close()
        try:
            self._open(kv_tokens)
        except ModelNotReady:
            try:
                self._open(old)
            except ModelNotReady as err:
                raise ModelFailed(f"llama.cpp: the KV pool was lost while growing it: {err.message}") from None
            self._carry(states)
            raise
        self._carry(states)

    def _carry(self, states: dict[int, bytes]) -> None:
        for seq, data in states.items():
            if self.restore(seq, data) == 0:
                raise ModelFailed(f"llama.cpp: sequence {seq}'s KV did not fit the new pool of {self.kv_tokens}")

    def set_threads(self, threads: int) -> None:
        self.lib.llama_set_n_threads(self.ctx, threads, threads)
        self.threads = threads

    def run(self, feeds: list[Feed]) -> list[np.ndarray | None]:
        if not self.ctx:
            raise ModelFailed("llama.cpp: this instance's KV pool was lost (see the log)")
        total, outputs = sum(len(f.tokens) for f in feeds), sum(f.outputs for f in feeds)
        if total > self.step_tokens or outputs > self.outputs_max:   # llama.cpp would abort the process
            raise ValueError(f"a step of {total} tokens and {outputs} outputs exceeds the batch of "
                             f"{self.step_tokens} and {self.outputs_max}")
        b = self.batch
        i, spans = 0, []
        for feed in feeds:
            first_out = len(feed.tokens) - feed.outputs
            for j, token in enumerate(feed.tokens):
                b.token[i], b.pos[i], b.n_seq_id[i] = token, feed.start + j, 1
                b.seq_id[i][0] = feed.seq
                b.logits[i] = j >= first_out
                i += 1
            spans.append((i - feed.outputs, feed.outputs))
        b.n_tokens = i
        status = self.lib.llama_decode(self.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status}: {'no KV cell free' if status == 1 else 'error'})")
        vocab = self.model.vocab_size
        out: list[np.ndarray | None] = []
        for start, n in spans:
            if n == 0:
                out.append(None)
                continue
            rows = [np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, r), shape=(vocab,))
                    for r in range(start, start + n)]
            out.append(np.stack(rows))
        return out

    def cut(self, seq: int, start: int = 0) -> bool:
        return bool(self.lib.llama_memory_seq_rm(self.memory, seq, start, -1))

    def state_bytes(self, seq: int) -> int:
        return int(self.lib.llama_state_seq_get_size(self.ctx, seq))

    def save(self, seq: int) -> bytes:
        size = self.lib.llama_state_seq_get_size(self.ctx, seq)
        buf = bytearray(size)   # written in place and kept: one copy of a state that may be 100s of MB
        n = self.lib.llama_state_seq_get_data(self.ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, seq)
        del buf[n:]
        return buf   # type: ignore[return-value]  # a bytes-like the prefix cache keeps as it is

    def restore(self, seq: int, data: bytes) -> int:
        view = (ctypes.c_uint8 * len(data))
        buf = view.from_buffer(data) if isinstance(data, bytearray) else view.from_buffer_copy(data)
        if self.lib.llama_state_seq_set_data(self.ctx, buf, len(data), seq) == 0:
            return 0
        return int(self.lib.llama_memory_seq_pos_max(self.memory, seq)) + 1

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None


class LlamaCppGrammar:
    """A GBNF grammar as a token mask (ember.runtimes.llm_sampling.Mask), through llama.cpp's grammar sampler."""

    def __init__(self, model: LlamaCppModel, gbnf: str) -> None:
        lib = model.lib
        self.lib = lib
        self.sampler = lib.llama_sampler_init_grammar(model.vocab, gbnf.encode(), b"root")
        if not self.sampler:
            raise InvalidInput("response_format: the grammar for it could not be compiled (see the log)")
        n = model.vocab_size
        self.ids = np.arange(n, dtype=np.int32)
        self.data = np.zeros(n, dtype=np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)]))
        self.array = lib.llama_token_data_array(
            data=self.data.ctypes.data_as(lib.llama_token_data_p), size=n, selected=-1, sorted=False)

    def allowed(self, logits: np.ndarray) -> np.ndarray:
        self.data["id"], self.data["logit"], self.data["p"] = self.ids, logits, 0.0
        self.array.size, self.array.selected, self.array.sorted = len(self.data), -1, False
        self.lib.llama_sampler_apply(self.sampler, ctypes.byref(self.array))
        out = np.full(len(logits), -np.inf, dtype=np.float32)
        kept = self.data[: self.array.size]
        out[kept["id"]] = kept["logit"]
        return out

    def accept(self, token: int) -> None:
        self.lib.llama_sampler_accept(self.sampler, token)

    def __del__(self) -> None:
        if getattr(self, "sampler", None):
            self.lib.llama_sampler_free(self.sampler)
            self.sampler = None
