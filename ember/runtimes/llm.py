"""The `llm` runtime: generative Llama-family LLMs from a GGUF file (SmolLM2-135M-Instruct is the bundled one).

Weights (`weights`, resolved by `ModelContract.weights_path()`): one `.gguf` file. Its first load de-quantises
it into a cached directory (config.json, model.safetensors, tokenizer.json, the chat template, generation
settings; see ember.runtimes.gguf_convert); every later load builds `LlamaForCausalLM` on the meta device and
assigns the tensors mmapped from that directory's safetensors: no copy, shared by every forked instance.

Dtype: float32, measured. On this CPU (2 cores, AVX-512 + AMX-BF16), SmolLM2-135M, 64 greedy tokens after a
38-token chat prompt (prefill included), KV cache, median of 5: 1 thread fp32 18.2 tok/s, bf16 19.1; 2 threads
fp32 29.3, bf16 26.5. Decoding a model this small is bound by per-layer Python and dispatch overhead, not by the
matmuls, so neither wins clearly; and bf16 changes greedy output: on 11 of 20 short chat prompts it picked
another token within 64 (a Q4_1 weight, an fp16 scale times a 4-bit step plus an fp16 offset, is exact in fp32
but rounded to 8 mantissa bits in bf16). So fp32, which also matches transformers' own GGUF loading token for
token. It costs 538 MB of page cache per model (shared by instances) against 269 MB; `options.dtype: bfloat16`
picks the smaller one.

Contract I/O conventions (checked at load; a deviation is ContractInvalid naming the key):
  input  `request`            BYTES [1]  one UTF-8 JSON object:
           {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]} (rendered with the chat
           template, add_generation_prompt=True) or {"prompt": str} (raw text), and optionally
           "max_tokens" (int >= 1; default: the room left in the context, at most options.default_max_tokens),
           "temperature" (0..2, default 1.0; 0 is greedy), "top_p" (0 < p <= 1, default 1),
           "seed" (an integer, taken mod 2**64; default: os.urandom), "stop" (a string or a list of up to 4,
           each 1 to 256 characters).
  output `text`               BYTES [1]  this reply's new text (whole UTF-8 characters; a stop string is cut off)
  output `finish_reason`      BYTES [1]  b"" until the last reply, then b"stop" (EOS or a stop string) or b"length"
  output `prompt_tokens`      INT64 [1]
  output `completion_tokens`  INT64 [1]  generated so far (an EOS token counts)
  output `cached_tokens`      INT64 [1]  optional: prompt tokens whose KV came from the prefix cache
`stream` gives one reply per generated token; `infer` one reply with the whole completion. Every stream of the
process joins one decoder (continuous batching, ember.runtimes.llm_decoder) with a prefix cache
(ember.runtimes.llm_prefix) whose declared and learned prefixes persist as snapshots (ember.runtimes.llm_snapshot).
Contract `options` (optional): `LLMOptions` below (docs/llm.md has the table).

Errors: a bad request is InvalidInput whose message starts with the field ("max_tokens: must be at least 1",
"messages[2].role: ...", "messages: prompt of 9000 tokens exceeds the context of 8192 ..."); a missing or
unusable GGUF is ModelNotReady. `stop()` is checked before every forward pass (prefill chunks included):
True raises Cancelled. Sampling uses a per-request torch.Generator, never the global RNG.

Fork safety: `preload()` only imports; `load()` may convert (numpy only), assigns mmapped tensors and prefills
the declared prefixes on the process's one thread (the zygote and template run with one; at one thread torch
starts no pool), and the weight store it opens for snapshots is closed again (its threads joined). So a template
may load, warm up (`warms_in_template`) and still fork safely; ember.node.template checks the thread count.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ember.errors import Cancelled, ContractInvalid, EmberError, InvalidInput, ModelNotReady
from ember.runtimes import parse_options
from ember.runtimes.llm_batch import LlamaWeights
from ember.runtimes.llm_decoder import Decoder, Sequence, Token
from ember.runtimes.llm_prefix import PrefixCache
from ember.runtimes.llm_request import Request, parse_request, reply
from ember.runtimes.weights import local_weights
from ember.wire.contract import ModelContract

if TYPE_CHECKING:  # torch, transformers and tokenizers come in with preload()/load()
    import torch
    from tokenizers import Tokenizer

    from ember.runtimes import StopCheck
    from ember.store import WeightStore

_IO = {"request": ("BYTES", "input"), "text": ("BYTES", "output"), "finish_reason": ("BYTES", "output"),
       "prompt_tokens": ("INT64", "output"), "completion_tokens": ("INT64", "output"),
       "cached_tokens": ("INT64", "output")}
_OPTIONAL = frozenset({"cached_tokens"})


class LLMOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16"] = "float32"
    default_max_tokens: int = Field(default=512, ge=1, le=1_000_000)
    max_tokens_in_flight: int = Field(default=16384, ge=1, le=10_000_000)   # prompt + budget, all running streams
    prefix_cache_mb: int = Field(default=256, ge=0, le=1_000_000)          # 0: no prefix cache
    snapshots: bool = True                       # restore and save KV-prefix snapshots in the weight store
    snapshot_encoding: Literal["float32", "int8"] = "int8"   # measured: tests/.../test_llm_snapshots.py
    learned_snapshots: int = Field(default=4, ge=0, le=64)   # hottest learned prefixes kept when an instance retires


def pick_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token: argmax at temperature 0, else a draw from the top-p nucleus of softmax(logits / T)."""
    import torch

    if temperature == 0 or generator is None:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p   # the first token always stays
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


def compile_template(source: str) -> Any:
    """A chat template in a sandboxed jinja2 environment set up as transformers sets it up."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class LLMRuntime:
    """Loads GGUF files into `LLMModel`s, converting each once (see ember.runtimes.gguf_convert)."""

    name = "llm"

    def __init__(self, cache_root: Path | None = None) -> None:
        self.cache_root = cache_root   # None: the weight store's root ($EMBER_STORE, else ~/.cache/ember/store)

    def preload(self) -> None:
        # Heavy imports only: no tensor is made, so no thread pool starts before the zygote forks.
        import jinja2.sandbox  # noqa: F401
        import safetensors.torch  # noqa: F401
        import tokenizers  # noqa: F401
        import torch  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401

    def _load_from_store(self, contract: ModelContract, store: WeightStore | None, options: LLMOptions) -> LLMModel:
        """A converted model pushed into the weight store (`ember store push model.gguf NAME` converts and pushes):
        its small files materialised once per node, its tensors views of the store's chunks (fetched from the
        origin if missing: the FETCH rung). Snapshots go to the same store."""
        from ember.runtimes.weights import store_files, store_tensors

        if options.dtype != "float32":
            raise ContractInvalid(f"model '{contract.key}': options.dtype: store weights hold what was pushed "
                                  "(float32); convert with that dtype to push another")
        root = store_files(contract, store)
        tensors = store_tensors(contract, store, "model.safetensors")
        model = LLMModel(contract, root, options, tensors)
        assert store is not None   # store_files refused a node without one
        model.store_root = store.root
        if options.snapshots and options.prefix_cache_mb > 0:
            model.prepare_prefixes(store.root)
        return model

    def load(self, contract: ModelContract, store: WeightStore | None = None) -> LLMModel:
        from ember.runtimes.gguf_convert import converted_dir
        from ember.store.config import default_root

        where = f"model '{contract.key}'"
        options = parse_options(contract, LLMOptions)
        _check_io(contract)
        if contract.store_ref is not None:
            return self._load_from_store(contract, store, options)
        gguf = local_weights(contract)
        if gguf is None or gguf.suffix != ".gguf":
            raise ContractInvalid(f"{where}: weights: the llm runtime needs a .gguf file, got {contract.weights!r}")
        if not gguf.is_file():
            raise ModelNotReady(f"{where}: weights file {str(gguf)!r} does not exist")
        store_root = self.cache_root or default_root()
        root = converted_dir(gguf.resolve(), store_root, options.dtype)
        model = LLMModel(contract, root, options)
        model.store_root = store_root
        if options.snapshots and options.prefix_cache_mb > 0:
            model.prepare_prefixes(store_root)
        return model


class LLMModel:
    """A loaded generative model: `stream({"request": ...})` yields one reply per token."""

    streams = True
    warms_in_template = True   # one-threaded decoding starts no thread pool: the template may generate and fork

    def __init__(self, contract: ModelContract, root: Path, options: LLMOptions,
                 tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        from tokenizers import Tokenizer
        from transformers import LlamaConfig

        self.contract, self.root, self.options = contract, root, options
        try:
            self.config = LlamaConfig.from_dict(json.loads((root / "config.json").read_text()))
            settings = json.loads((root / "generation.json").read_text())
            # What was converted (the GGUF's key and the dtype), wherever the files now live: names snapshots.
            self.model_id = str(json.loads((root / "ember.json").read_text()).get("key") or root.name)
            self.template = compile_template((root / "chat_template.jinja").read_text())
            self.tokenizer: Tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
            self.model = build_llama(self.config, tensors if tensors is not None else root / "model.safetensors")
        except Exception as err:  # a damaged cache entry (conversions are renamed into place whole): say which
            raise ModelNotReady(f"model '{contract.key}': {root}: unusable converted model (delete it to convert "
                                f"again): {type(err).__name__}: {err}") from None
        self._decoder: Decoder | None = None
        self._saved: set[tuple[int, ...]] = set()   # prefixes the store holds already
        self.store_root: Path | None = None
        self._outputs = frozenset(spec.name for spec in contract.outputs)
        self.context = int(settings["context_length"])
        self.eos = frozenset(int(i) for i in settings["eos_token_ids"])
        self.bos_id: int | None = settings.get("bos_token_id")
        self.add_bos = bool(settings.get("add_bos_token")) and self.bos_id is not None
        self.bos_token = self.tokenizer.id_to_token(self.bos_id) if self.bos_id is not None else ""
        self.eos_token = self.tokenizer.id_to_token(min(self.eos)) if self.eos else ""

    # --- prefixes: declared, learned, snapshots ----------------------------------------------------

    def declared_prefixes(self) -> list[list[int]]:
        """The prompts of the contract's warmup requests, as token ids: the prefixes it asks to keep warm."""
        values = (self.contract.warmup.inputs or {}).get("request", ())
        prompts = []
        for value in values:
            with contextlib.suppress(EmberError):   # the warm-up itself reports a bad warmup request
                prompts.append(self.prompt_ids(parse_request(str(value).encode())))
        return prompts

    def prepare_prefixes(self, store_root: Path) -> dict[str, int]:
        """Fill the prefix cache: restore the snapshots of declared and learned prefixes from the weight store,
        compute the declared ones it lacks and save them. Counts of each, for logs and tests."""
        from ember.runtimes import llm_snapshot as snap

        counts = {"restored": 0, "computed": 0}
        with _store(store_root) as store:
            declared = {snap.snapshot_name(self.model_id, ids, self.options.snapshot_encoding): ids
                        for ids in self.declared_prefixes()}
            for name in [*declared, *snap.read_learned(store_root, self.model_id)]:
                found = snap.restore(store, name, self.decoder.w.dtype)
                if found is not None:
                    self.decoder.cache.insert(*found)
                    self._saved.add(tuple(found[0]))
                    counts["restored"] += 1
            for name, ids in declared.items():
                if tuple(ids) in self._saved:
                    continue
                self.tokens(ids, Request(prompt="", temperature=0.0), 1)   # the prefill fills the cache
                kv = self.decoder.cache.get(ids)
                if kv is not None:
                    snap.save(store, name, ids, kv, self.options.snapshot_encoding)
                    self._saved.add(tuple(ids))
                    counts["computed"] += 1
        return counts

    def retire(self, store_root: Path | None = None) -> int:
        """Before the instance leaves: save its hottest learned prefixes as snapshots and list them for later
        loads (the hottest first, then those listed before). The number saved."""
        from ember.runtimes import llm_snapshot as snap
        from ember.store.config import default_root

        if not self.options.snapshots or self._decoder is None or self.options.learned_snapshots == 0:
            return 0
        hottest = [(ids, kv) for ids, kv in self.decoder.cache.hottest(self.options.learned_snapshots)
                   if ids not in self._saved]
        if not hottest:
            return 0
        root = store_root or self.store_root or default_root()
        names = []
        with _store(root) as store:
            for ids, kv in hottest:
                names.append(snap.snapshot_name(self.model_id, list(ids), self.options.snapshot_encoding))
                snap.save(store, names[-1], list(ids), kv, self.options.snapshot_encoding)
        kept = [*names, *(n for n in snap.read_learned(root, self.model_id) if n not in names)]
        snap.write_learned(root, self.model_id, kept[: self.options.learned_snapshots])
        return len(names)

    # --- requests ------------------------------------------------------------------------------

    def prompt_ids(self, request: Request) -> list[int]:
        """The prompt's token ids (the chat template rendered for messages); InvalidInput if it does not fit."""
        if request.messages is not None:
            from jinja2 import TemplateError

            messages = [{"role": role, "content": content} for role, content in request.messages]
            try:
                text = self.template.render(messages=messages, add_generation_prompt=True,
                                            bos_token=self.bos_token, eos_token=self.eos_token)
            except TemplateError as err:
                raise InvalidInput(f"messages: the model's chat template rejects them: {err}") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            assert request.prompt is not None
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=False).ids
            if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
                ids = [self.bos_id, *ids]
        if not ids:
            raise InvalidInput(f"{request.field}: the prompt is empty (no tokens)")
        if len(ids) >= self.context:
            raise InvalidInput(f"{request.field}: prompt of {len(ids)} tokens exceeds the context of {self.context} "
                               "(it must leave room for at least one new token)")
        return ids

    def budget(self, request: Request, prompt_tokens: int) -> int:
        room = self.context - prompt_tokens
        if request.max_tokens is None:
            return min(room, self.options.default_max_tokens)
        if request.max_tokens > room:
            raise InvalidInput(f"max_tokens: {request.max_tokens} exceeds the context of {self.context} tokens "
                               f"less the prompt's {prompt_tokens} (at most {room})")
        return request.max_tokens

    def infer(self, inputs: Mapping[str, np.ndarray], stop: StopCheck | None = None) -> dict[str, np.ndarray]:
        """The whole completion as one reply."""
        parts, last = [], None
        for token in self.generate(self.request_of(inputs), stop):
            parts.append(token.text)
            last = token
        assert last is not None
        return self._reply("".join(parts), last)

    def stream(self, inputs: Mapping[str, np.ndarray],
               stop: StopCheck | None = None) -> Iterator[dict[str, np.ndarray]]:
        """One reply per generated token; the last one carries the finish reason."""
        request = self.request_of(inputs)   # parsed before the first reply: a bad request answers no reply
        for t in self.generate(request, stop):
            yield self._reply(t.text, t)

    def _reply(self, text: str, t: Token) -> dict[str, np.ndarray]:
        out = reply(text, t.finish, t.prompt_tokens, t.completion_tokens, t.cached_tokens)
        return {name: a for name, a in out.items() if name in self._outputs}

    def request_of(self, inputs: Mapping[str, np.ndarray]) -> Request:
        if "request" not in inputs:
            raise InvalidInput(f"input 'request': missing (model '{self.contract.name}' requires it)")
        items = np.asarray(inputs["request"], dtype=object).reshape(-1)
        if len(items) != 1 or not isinstance(items[0], bytes | str | np.bytes_):
            raise InvalidInput("request: expected one UTF-8 JSON object")
        raw = items[0].encode() if isinstance(items[0], str) else bytes(items[0])
        return parse_request(raw, self.contract.limits.max_tokens)

    @property
    def decoder(self) -> Decoder:
        """The instance's one decoder: every stream of this process joins its batch (made on first use, so in
        the process that generates: a template that forks never holds KV buffers it would not use)."""
        if self._decoder is None:
            self._decoder = Decoder(LlamaWeights(self.model), self.eos, self.contract.max_concurrency,
                                    self.options.max_tokens_in_flight,
                                    PrefixCache(self.options.prefix_cache_mb << 20), _pick,
                                    lambda t: self.tokenizer.decode(t, skip_special_tokens=True))
        return self._decoder

    def generate(self, request: Request, stop: StopCheck | None = None) -> Iterator[Token]:
        """One Token per generated token, the last with its finish reason. The request joins the decoder's
        batch; whichever caller finds its outbox empty runs a step for everyone (ember.runtimes.llm_decoder)."""
        ids = self.prompt_ids(request)
        seq = self.decoder.add(request, ids, self.budget(request, len(ids)), stop)
        try:
            while True:
                while not seq.outbox:
                    self.decoder.step()
                item = seq.outbox.popleft()
                if isinstance(item, BaseException):
                    raise Cancelled(f"model '{self.contract.key}': {item}")
                yield item
                if item.finish:
                    return
        finally:
            self.decoder.drop(seq)

    def tokens(self, ids: list[int], request: Request, limit: int) -> list[int]:
        """The token ids generated after prompt `ids` (for parity tests: no text side)."""
        seq = self.decoder.add(request, ids, limit, None)
        try:
            while not seq.done:
                self.decoder.step()
        finally:
            self.decoder.drop(seq)
        return seq.generated


def _pick(logits: torch.Tensor, seq: Sequence) -> int:
    return pick_token(logits, seq.request.temperature, seq.request.top_p, seq.generator)


@contextlib.contextmanager
def _store(root: Path) -> Iterator[WeightStore]:
    """The weight store at `root`, closed after use: closing joins its threads, so a template may fork."""
    from ember.store.config import StoreConfig
    from ember.store.hashing import one_thread
    from ember.store.store import WeightStore

    with one_thread():   # blake3's pool would outlive the store: a template must fork with one thread
        # keep_memory_tier: a template and its replicas share this root's memory tier; none of them owns it.
        store = WeightStore(StoreConfig.build(root=root, keep_memory_tier=True))
        try:
            yield store
        finally:
            store.close()


def build_llama(config: Any, weights: Path | Mapping[str, torch.Tensor]) -> Any:
    """LlamaForCausalLM built on the meta device, its tensors assigned from `weights` (a safetensors file, mmapped,
    or views of the weight store's chunks): views of the page cache, shared by forked instances; no init, no
    copy. The rotary tables are computed (not in the file)."""
    import torch
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if isinstance(weights, Path):
        with safe_open(str(weights), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    else:
        tensors = dict(weights)
    name = weights.name if isinstance(weights, Path) else "the store's model.safetensors"
    missing = set(model.load_state_dict(tensors, strict=False, assign=True).missing_keys)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing.discard("lm_head.weight")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    missing |= {name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta}
    if missing:
        raise ValueError(f"{name} lacks {sorted(missing)[:5]}")
    return model.eval()


def _check_io(contract: ModelContract) -> None:
    """The contract's tensors must follow this runtime's conventions (see the module docstring)."""
    where = f"model '{contract.key}'"
    for kind, specs in (("input", contract.inputs), ("output", contract.outputs)):
        expected = [name for name, (_, k) in _IO.items() if k == kind]
        names = [spec.name for spec in specs]
        if sorted(set(names) | (_OPTIONAL & set(expected))) != sorted(expected) or len(set(names)) != len(names):
            required = [n for n in expected if n not in _OPTIONAL]
            optional = [n for n in expected if n in _OPTIONAL]
            raise ContractInvalid(f"{where}: {kind}s: the llm runtime takes {kind}s {', '.join(required)}"
                                  + (f" (and optionally {', '.join(optional)})" if optional else "")
                                  + f", not {', '.join(names)}")
        for spec in specs:
            datatype = _IO[spec.name][0]
            if spec.datatype != datatype or spec.shape != (1,):
                raise ContractInvalid(f"{where}: {kind}s.{spec.name}: expected {datatype} [1], "
                                      f"got {spec.datatype} {list(spec.shape)}")

