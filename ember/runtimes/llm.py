"""The `llm` runtime: generative LLMs from a GGUF file, on llama.cpp (SmolLM2-135M-Instruct is the bundled one).

Weights (`weights`, resolved by `ModelContract.weights_path()`, or `store:NAME` pushed by `ember store push
model.gguf NAME`): one `.gguf` file, mapped by llama.cpp as it is (quantised; its pages shared by every process
that maps it and every instance forked from a template). Every architecture llama.cpp supports is served. The
engine sits behind a small seam (ember.runtimes.llm_engine); what ember adds is here and beside it: the chat
template rendered in a sandbox, continuous batching with chunked prefill and admission by KV cells
(ember.runtimes.llm_decoder), per-sequence sampling (llm_sampling), tool calls and structured output
(llm_tools), the prefix cache (llm_prefix) and its snapshots in the weight store (llm_snapshot).

The request and reply convention (the `request` input's JSON; outputs text, finish_reason, prompt_tokens,
completion_tokens and the optional cached_tokens, logprobs, tool_calls) is stated once, in
docs/llm-convention.md; `llm_request.check_convention` checks a contract against it (ContractInvalid naming the
key), `ember.wire.generation` parses a request. Contract `options`: `LLMOptions` below (docs/llm.md has the table).

Errors: a bad request is InvalidInput whose message starts with the field ("max_tokens: must be at least 1",
"messages: prompt of 9000 tokens exceeds the context of 8192 ..."), raised before the first reply and before
the request takes any KV; a missing or unusable GGUF is ModelNotReady. `stop()` is checked before every step:
True raises Cancelled.

Fork safety: `preload()` only imports llama-cpp-python; `load()` maps the file and, in a template, opens the
context and prefills the declared prefixes on the process's one thread (llama.cpp starts no thread for one),
and the weight store it opens for snapshots is closed again (its threads joined). So a template may load, warm
up (`warms_in_template`) and still fork safely; ember.node.template checks the thread count. An instance runs
on the threads its slice gives it (`OMP_NUM_THREADS`, set after the fork), read before every step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import ConfigDict, Field

from ember.errors import ContractInvalid, EmberError, InvalidInput, ModelFailed, ModelNotReady
from ember.runtimes import parse_options
from ember.runtimes.llm_decoder import Decoder, Sequence, Token
from ember.runtimes.llm_output import Output
from ember.runtimes.llm_prefix import SHARED, PrefixCache, Scope
from ember.runtimes.llm_request import check_biases, check_convention, checked_prompt, reply, request_of, token_budget
from ember.runtimes.llm_sampling import Sampler
from ember.runtimes.llm_snapshot import learned_id, model_id
from ember.runtimes.llm_template import (
    NO_TEMPLATE,
    TemplateOptions,
    compile_template,
    contract_template,
    template_tool_format,
)
from ember.runtimes.llm_tools import ToolFormat, check_tools, json_grammar
from ember.runtimes.weights import local_weights
from ember.wire.contract import ModelContract
from ember.wire.generation import Request, parse_request

if TYPE_CHECKING:
    from ember.runtimes import StopCheck
    from ember.runtimes.llm_engine import Context, EngineModel
    from ember.runtimes.llm_sampling import Mask
    from ember.runtimes.llm_snapshot import Learned
    from ember.store import WeightStore

DEFAULT_KV_TOKENS = 8192
# The pool a context opens with; it grows to `kv_tokens` as admission needs (ember.runtimes.llm_decoder.Decoder).
KV_START_TOKENS = 1024


class LLMOptions(TemplateOptions):
    """The contract's `options` for the llm runtime (with the chat template's: ember.runtimes.llm_template)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["llama.cpp"] = "llama.cpp"
    default_max_tokens: int = Field(default=512, ge=1, le=1_000_000)
    # The KV pool every running stream shares, in tokens: the longest prompt plus completion served (default:
    # the model's context, at most 8192) and what admission counts against.
    kv_tokens: int | None = Field(default=None, ge=16, le=1_048_576)
    kv_type: Literal["f16", "q8_0"] = "f16"            # q8_0: half the KV bytes (docs/llm.md measures it)
    # Tokens per step, decode rows plus prompt chunks: while a prompt is fed, the other streams get a token per
    # step, so this bounds their stall (256 tokens of SmolLM2 are ~2 s on one core here).
    step_tokens: int = Field(default=256, ge=16, le=8192)
    prefix_cache_mb: int = Field(default=256, ge=0, le=1_000_000)   # 0: no prefix cache
    # A prefix-cache hit computes the prompt's tail in other chunk shapes than a cold prompt, which rounds otherwise
    # and can flip greedy near-ties (bench/llm_repeatable.py). true: hits are cut to whole steps (step_tokens), so a
    # stream alone gives the same tokens with or without one (a stream batched with others still may not).
    repeatable: bool = False
    snapshots: bool = True                       # restore and save KV-prefix snapshots in the weight store
    learned_snapshots: int = Field(default=4, ge=0, le=64)   # hottest learned prefixes kept when an instance retires
    # llama.cpp's repacked weights (interleaved rows for this CPU's kernels: the 8B-shaped Q4_K decodes ~1.4x faster
    # here) are the loading process's own memory, not the mapped file's shared pages, and take seconds to make.
    # true: every load repacks; "template": the template repacks (its replicas share its copy) and a zygote's child
    # maps the file as it is (it starts in a fraction of the time); false: never.
    repack: bool | Literal["template"] = False


class LLMRuntime:
    """Loads GGUF files into `LLMModel`s on llama.cpp."""

    name = "llm"

    def __init__(self, cache_root: Path | None = None) -> None:
        self.cache_root = cache_root   # None: the weight store's root ($EMBER_STORE, else ~/.cache/ember/store)
        self._held: dict[tuple[str, int, int], EngineModel] = {}   # a zygote's mapped models, by file and stamp
        self._holders: dict[str, tuple[str, int, int]] = {}        # model key -> the file it holds

    def preload(self) -> None:
        # Imports only: llama-cpp-python and libllama mapped, the chat template's sandbox; no thread starts.
        import jinja2.sandbox  # noqa: F401

        from ember.runtimes import llamacpp

        llamacpp.preload()

    def hold(self, contract: ModelContract) -> bool:
        """In a zygote: map the model's GGUF and read its vocabulary now (no context, no thread), so that an instance
        forked later starts with both (an 8B-shaped Llama's load is ~0.1 s, mostly its 128k-token vocabulary).
        Not for a store-backed model (a zygote opens no store) nor `repack: true` (each load's own copy). Held by
        model key; models on one file share one load."""
        key = self._hold_key(contract)
        if key is None:
            return False
        if self._holders.get(contract.key, key) != key:   # the model again, on a changed file
            self.drop(contract)
        if key not in self._held:
            from ember.runtimes.llamacpp import LlamaCppModel

            self._held[key] = LlamaCppModel(Path(key[0]))
        self._holders[contract.key] = key
        return True

    def drop(self, contract: ModelContract) -> None:
        key = self._holders.pop(contract.key, None)
        if key is not None and key not in self._holders.values():
            held = self._held.pop(key, None)
            if held is not None:
                held.close()

    def keep(self, contract: ModelContract) -> None:
        """In a child forked from a zygote, before its sandbox: every held model but this contract's (as its file is
        now) is let go: a child maps no other model's weights, and its address-space limit counts only its own."""
        try:
            mine = self._hold_key(contract)
        except (EmberError, OSError):
            mine = None
        for key in [k for k in self._held if k != mine]:
            self._held.pop(key).close()
        self._holders.clear()

    def _hold_key(self, contract: ModelContract) -> tuple[str, int, int] | None:
        if contract.store_ref is not None or parse_options(contract, LLMOptions).repack is True:
            return None
        gguf = self.gguf(contract, None)
        stat = gguf.stat()
        return str(gguf), stat.st_mtime_ns, stat.st_size

    def _take_held(self, contract: ModelContract) -> EngineModel | None:
        """The contract's held model for this process's load, if any (every other one let go first)."""
        if not self._held:
            return None
        self.keep(contract)
        return self._held.popitem()[1] if self._held else None

    @staticmethod
    def template_contract(contract: ModelContract) -> ModelContract:
        """The contract as a template loads it: `repack: template` becomes `repack: true` there."""
        if parse_options(contract, LLMOptions).repack != "template":
            return contract
        return contract.model_copy(update={"options": {**contract.options, "repack": True}})

    def load(self, contract: ModelContract, store: WeightStore | None = None) -> LLMModel:
        from ember.runtimes.cpu_probe import repack_allowed
        from ember.runtimes.llamacpp import LlamaCppModel
        from ember.store.config import default_root

        options = parse_options(contract, LLMOptions)
        check_convention(contract, "llm")
        engine = self._take_held(contract)
        gguf = self.gguf(contract, store)
        store_root = store.root if store is not None and contract.store_ref else (self.cache_root or default_root())
        if engine is None:
            # Repacked kernels depend on this CPU: tried in a child process first (once per host and file).
            repack = options.repack is True and repack_allowed(gguf, store_root.parent / "probes")
            engine = LlamaCppModel(gguf, repack=repack)
        model = LLMModel(contract, engine, options, model_id(gguf))
        model.store_root = store_root
        if options.snapshots and options.prefix_cache_mb > 0:
            model.prepare_prefixes(model.store_root)
        return model

    @staticmethod
    def gguf(contract: ModelContract, store: WeightStore | None) -> Path:
        """The GGUF file: the contract's own, or the one a `store:` model holds (fetched if missing here)."""
        where = f"model '{contract.key}'"
        if contract.store_ref is not None:
            from ember.runtimes.weights import store_files

            found = sorted(store_files(contract, store, tensors=True).rglob("*.gguf"))
            if not found:
                raise ModelNotReady(f"{where}: weights {contract.weights!r}: the stored model holds no .gguf file")
            return found[0]
        gguf = local_weights(contract)
        if gguf is None or gguf.suffix != ".gguf":
            raise ContractInvalid(f"{where}: weights: the llm runtime needs a .gguf file, got {contract.weights!r}")
        if not gguf.is_file():
            raise ModelNotReady(f"{where}: weights file {str(gguf)!r} does not exist")
        return gguf


class PromptCheck:
    """An instance's own checks of a request (its fields, its prompt against the served context, its budget) run
    where there is no instance: the gateway refuses a prompt that cannot fit with a 400 before any rung is
    claimed. It loads the GGUF's vocabulary only (llama.cpp's vocab_only: no weights, no context, no thread):
    `gguf`, the contract's own file by default, or for a `store:` model its head (ember.runtimes.gguf_head)."""

    def __init__(self, contract: ModelContract, gguf: Path | None = None) -> None:
        from ember.runtimes.llamacpp import LlamaCppModel

        gguf = gguf or LLMRuntime.gguf(contract, None)
        options = parse_options(contract, LLMOptions)
        self.model = LLMModel(contract, LlamaCppModel(gguf, vocab_only=True), options, "prompt-check")

    def __call__(self, raw: bytes) -> None:
        """InvalidInput naming the field when the request would be refused by an instance at once: every check
        `generate` makes before its first step (a job accepted with a 202 must not fail on one later)."""
        request = parse_request(raw, self.model.contract.limits.max_tokens)
        self.model.budget(request, len(self.model.prompt_ids(request)))
        self.model.check_biases(request)
        self.model.mask(request)   # the schema or tools as a grammar over the vocabulary


class LLMModel:
    """A loaded generative model: `stream({"request": ...})` yields one reply per token.

    Its prefix cache is scoped by tenant (ember.runtimes.llm_prefix): a request is served only by the prefixes of
    its own tenant's requests (`tenant`: the caller's, given by the node; without one, the model's own tenant's)
    and the contract's declared ones; only its model's own tenant's are handed over as learned on retiring."""

    streams = True
    per_tenant = True          # `stream` takes the caller's tenant (ember.runtimes.replies_of)
    warms_in_template = True   # one-threaded steps start no thread: the template may generate and fork

    def __init__(self, contract: ModelContract, engine: EngineModel, options: LLMOptions, name: str) -> None:
        """`name`: the GGUF's identity (`llm_snapshot.model_id`), which names the declared prefixes' snapshots."""
        self.contract, self.engine, self.options, self.model_id = contract, engine, options, name
        self.learned_id = learned_id(name, contract)   # names the learned ones: this tenant's and model's only
        source = contract_template(contract, options) or engine.chat_template   # the contract's replaces the GGUF's
        self.template = compile_template(source) if source else None
        self.tool_format: ToolFormat | None = template_tool_format(options, source)
        self.context = min(options.kv_tokens or min(engine.context_length, DEFAULT_KV_TOKENS),
                           engine.context_length or DEFAULT_KV_TOKENS)
        self.eos = engine.eos
        self.bos_token = engine.token_text(engine.bos) if engine.bos is not None else ""
        self.eos_token = engine.token_text(min(self.eos)) if self.eos else ""
        self._outputs = frozenset(spec.name for spec in contract.outputs)
        self._ctx: Context | None = None
        self._decoder: Decoder | None = None
        self._threads = 1
        self._saved: set[tuple[int, ...]] = set()   # prefixes the store holds already
        self.store_root: Path | None = None

    # --- the engine context ---------------------------------------------------------------------

    @property
    def decoder(self) -> Decoder:
        """The instance's one decoder over one context: every stream of this process joins its batch (made on
        first use: in a template by its warm-up, on one thread; the KV pool is the template's, copied on write)."""
        if self._decoder is None:
            self._ctx = self.engine.open(self.contract.max_concurrency, min(self.context, KV_START_TOKENS),
                                         threads=1, kv_type=self.options.kv_type, step_tokens=self.options.step_tokens)
            self._decoder = Decoder(self._ctx, PrefixCache(self.options.prefix_cache_mb << 20,
                                                           whole=not self._ctx.can_cut), self.options.step_tokens,
                                    kv_max=self.context, aligned=self.options.repeatable)
        threads = _threads()
        if threads != self._threads and self._ctx is not None:   # an instance's slice, set after the fork
            self._ctx.set_threads(threads)
            self._threads = threads
        return self._decoder

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
        kv = self.options.kv_type
        with snap.opened(store_root) as store:
            declared = {snap.snapshot_name(self.model_id, ids, kv): ids for ids in self.declared_prefixes()}
            learned = snap.read_learned(store_root, self.learned_id)[:self.options.learned_snapshots]   # 0: none
            for name, scope in [*((n, SHARED) for n in declared), *((n, self.contract.tenant) for n in learned)]:
                found = snap.restore(store, name)
                if found is not None:
                    self.decoder.cache.insert(*found, scope)
                    self._saved.add(tuple(found[0]))
                    counts["restored"] += 1
            for name, ids in declared.items():
                if tuple(ids) in self._saved:
                    continue
                self.tokens(ids, Request(prompt="", temperature=0.0), 1, declared=True)   # its prefill fills the cache
                state = self.decoder.cache.get(ids, SHARED)
                if state is not None:
                    snap.save(store, name, ids, state)
                    self._saved.add(tuple(ids))
                    counts["computed"] += 1
        return counts

    def retire(self) -> Learned | None:
        """Before the instance leaves: its hottest learned prefixes not in the store yet, for its node to keep
        (`llm_snapshot.keep`: a sandboxed instance sees the store read-only). None when there are none."""
        from ember.runtimes.llm_snapshot import Learned
        from ember.store.config import default_root

        if not self.options.snapshots or self._decoder is None or self.options.learned_snapshots == 0:
            return None
        mine = self._decoder.cache.hottest(self.options.learned_snapshots, self.contract.tenant)   # its tenant's
        hottest = tuple((ids, state) for ids, state in mine if ids not in self._saved)
        if not hottest:
            return None
        self._saved.update(ids for ids, _state in hottest)
        return Learned(self.learned_id, self.options.kv_type, self.options.learned_snapshots,
                       self.store_root or default_root(), hottest)

    # --- requests ------------------------------------------------------------------------------

    def render(self, request: Request) -> str:
        """The chat template rendered for the request's messages (and tools, unless tool_choice is none)."""
        if self.template is None:
            raise InvalidInput(NO_TEMPLATE)
        assert request.messages is not None
        from jinja2 import TemplateError

        extra: dict[str, Any] = {}
        if request.calls_tools:
            extra["tools"] = list(request.tools)
        try:
            return str(self.template.render(messages=[m.for_template() for m in request.messages],
                                            add_generation_prompt=True, bos_token=self.bos_token,
                                            eos_token=self.eos_token, **extra))
        except TemplateError as err:
            raise InvalidInput(f"messages: the model's chat template rejects them: {err}") from None

    def prompt_ids(self, request: Request) -> list[int]:
        """The prompt's token ids (the chat template rendered for messages); InvalidInput if it does not fit."""
        check_tools(request, self.tool_format)
        if request.messages is not None:
            ids = self.engine.tokenize(self.render(request), special=True)
        else:
            assert request.prompt is not None
            ids = self.engine.tokenize(request.prompt, special=False)
        bos = self.engine.bos
        if self.engine.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return checked_prompt(ids, request, self.context)

    def budget(self, request: Request, prompt_tokens: int) -> int:
        return token_budget(request, prompt_tokens, self.context, self.options.default_max_tokens)

    def infer(self, inputs: Mapping[str, np.ndarray], stop: StopCheck | None = None) -> dict[str, np.ndarray]:
        """The whole completion as one reply."""
        parts, logprobs, last = [], [], None
        for token in self.generate(self.request_of(inputs), stop):
            assert token is not None   # generate waits for tokens unless asked not to
            parts.append(token.text)
            logprobs.extend(token.logprobs or [])
            last = token
        assert last is not None
        return self._reply("".join(parts), last, logprobs if last.logprobs is not None else None)

    def stream(self, inputs: Mapping[str, np.ndarray], stop: StopCheck | None = None, *,
               tenant: str | None = None) -> Iterator[dict[str, np.ndarray] | None]:
        """One reply per generated token, the last with the finish reason; None where one step made no token for
        this stream (a prompt chunk, a wait for KV cells): the instance server asks again on its next round, so
        the other streams' tokens go out meanwhile (ember.node.instance). `tenant`: the caller's (None: none)."""
        request = self.request_of(inputs)   # parsed before the first reply: a bad request answers no reply
        for t in self.generate(request, stop, wait=False, tenant=tenant):
            yield None if t is None else self._reply(t.text, t, t.logprobs)

    def _reply(self, text: str, t: Token, logprobs: list[dict[str, Any]] | None) -> dict[str, np.ndarray]:
        out = reply(text, t.finish, t.prompt_tokens, t.completion_tokens, t.cached_tokens, logprobs, t.tool_calls)
        return {name: a for name, a in out.items() if name in self._outputs}

    def scope_of(self, tenant: str | None) -> Scope:
        """The prefix-cache scope of a request by `tenant`: its own; without one (authentication off, or a request
        of the instance itself: its warmup), the model's tenant's."""
        return tenant if tenant is not None else self.contract.tenant

    def request_of(self, inputs: Mapping[str, np.ndarray]) -> Request:
        return request_of(inputs, self.contract)

    def sequence(self, request: Request, ids: list[int], limit: int, stop: StopCheck | None,
                 scope: Scope) -> Sequence:
        """A request as the decoder's Sequence: its sampler (with a grammar where asked), its output, and the
        prefix-cache scope it uses and fills."""
        self.check_biases(request)
        sampler = Sampler(request.temperature, request.top_p, request.seed, logit_bias=dict(request.logit_bias),
                          logprobs=request.logprobs, top_logprobs=request.top_logprobs, mask=self.mask(request))
        tools = self.tool_format if request.calls_tools else None
        names = frozenset(t["function"]["name"] for t in request.tools)
        output = Output(self.engine.piece, self.eos, request.stop, logprobs=request.logprobs,
                        top_logprobs=request.top_logprobs, tools=tools,
                        prefix=request.prompt or "" if request.echo else "", tool_names=names, tags=self._tags(tools))
        return Sequence(ids, limit, stop, sampler, output, echo_logprobs=request.echo and request.logprobs,
                        scope=scope)

    def _tags(self, tools: ToolFormat | None) -> dict[int, bytes]:
        """The format's opening tag when the vocabulary has it as one control token (which has no text)."""
        if tools is None or not tools.open:
            return {}
        ids = self.engine.tokenize(tools.open, special=True)
        return {ids[0]: tools.open.encode()} if len(ids) == 1 and not self.engine.piece(ids[0]) else {}

    def check_biases(self, request: Request) -> None:
        check_biases(request, self.engine.vocab_size)

    def mask(self, request: Request) -> Mask | None:
        choice = request.tool_choice
        if request.calls_tools and (choice == "required" or isinstance(choice, dict)):
            assert self.tool_format is not None   # render() refused tools without a format
            only = choice["function"]["name"] if isinstance(choice, dict) else None
            return self.engine.grammar(self.tool_format.grammar(request.tools, only))
        if request.response_format is not None:
            return self.engine.grammar(json_grammar(request.response_format.get("schema")))
        return None

    def generate(self, request: Request, stop: StopCheck | None = None, *, wait: bool = True,
                 tenant: str | None = None) -> Iterator[Token | None]:
        """One Token per generated token, the last with its finish reason. The request joins the decoder's
        batch; whichever caller finds its outbox empty runs a step for everyone (ember.runtimes.llm_decoder).
        `wait=False`: at most one step per item, and None when it made no token for this request; and while
        another stream's token waits for its reader, None first instead of a step (the instance server reaches
        that reader in this round: a token made for a stream it has passed would otherwise wait for every other
        stream's step), once per step of the decoder, so that a reader who does not come cannot stall this one.
        `tenant`: the caller's, whose prefixes it may use (`scope_of`)."""
        ids = self.prompt_ids(request)
        seq = self.decoder.add(self.sequence(request, ids, self.budget(request, len(ids)), stop,
                                             self.scope_of(tenant)))
        deferred_at = -1   # the decoder's step count when this stream last let another's token go first
        try:
            while True:
                while not seq.outbox:
                    if not wait and self.decoder.undelivered() and deferred_at != self.decoder.decode_steps:
                        deferred_at = self.decoder.decode_steps
                        yield None
                        continue
                    self.decoder.step()
                    if not seq.outbox and not wait:
                        yield None
                item = seq.outbox.popleft()
                if isinstance(item, BaseException):
                    raise _failure(self.contract.key, item)
                yield item
                if item.finish:
                    return
        finally:
            self.decoder.drop(seq)

    def tokens(self, ids: list[int], request: Request, limit: int, *, declared: bool = False) -> list[int]:
        """The token ids generated after prompt `ids` (for parity tests and benchmarks: no text side), in the model's
        tenant's scope, or (`declared`) as a declared prefix every scope shares."""
        scope = SHARED if declared else self.scope_of(None)
        seq = self.decoder.add(self.sequence(request, ids, limit, None, scope))
        try:
            while not seq.done:
                self.decoder.step()
        finally:
            self.decoder.drop(seq)
        return seq.generated


def _failure(key: str, err: BaseException) -> EmberError:
    """What a sequence's failure becomes for its caller: ember's own errors as they are (a stop is Cancelled, a
    grammar's dead end InvalidInput), anything else a ModelFailed naming the model."""
    if isinstance(err, EmberError):
        return err
    return ModelFailed(f"model '{key}': generation failed: {type(err).__name__}: {err}")


def _threads() -> int:
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1
