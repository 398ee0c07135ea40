"""The `vllm` runtime: generative LLMs from a Hugging Face directory, on vLLM's engine, in the `vllm` environment.

It runs only in that environment (`ember env build vllm`; the node starts its zygote with the environment's
interpreter, ember.environments): vLLM pins its own torch. Weights (`weights`): a directory with config.json and
safetensors (any architecture vLLM serves), or `store:NAME` pushed with `ember store push DIR NAME --as-is`.

The engine is vLLM's own `LLMEngine` in the instance's process (VLLM_ENABLE_V1_MULTIPROCESSING=0: no engine-core
process, so pausing the instance stops all of it), with its continuous batching and prefix caching; ember
speaks the `llm` runtime's request and reply convention (docs/llm-convention.md, parsed by llm_request): the
gateway's OpenAI and V2 generate APIs serve it as they serve the llm runtime. Every stream of an instance adds its
request to the one engine; whichever stream finds nothing waiting runs `engine.step()` for all (the same shape
as ember.runtimes.llm_decoder), and yields None when the step brought it nothing, so the instance server sends
the other streams' tokens meanwhile; a new stream yields None once after adding its request, before any step, so
streams that arrived together share one prefill step. A stop (client gone, deadline) aborts the request in the engine.

Tools and structured output as the llama.cpp engine serves them (ember.runtimes.llm_tools): tools rendered by the
model's chat template, calls parsed from the text in the format it teaches (held back while text may still become
one); `tool_choice` `required` or a named function, and `response_format` `json_object`/`json_schema`, constrain
the output through vLLM's structured outputs (xgrammar), from the same schemas and framing as llama.cpp's GBNF.
Completions' `echo` leads the first reply with the prompt, and with `logprobs` its tokens' log-probabilities
(vLLM's prompt logprobs; the first token has none), as lm-eval-harness asks.

Sleep mode: where vLLM's platform has it (CUDA, ROCm; not the CPU build) the engine is built with
`enable_sleep_mode` (option `sleep_mode: auto`, the default; `off` builds it without) and the model offers sleep
levels 1 and 2 to the node (`ember.node.instance`): level 1 moves the weights to host memory and drops the KV cache,
level 2 discards both; waking from level 2 reloads the weights from the model's directory (vLLM's `reload_weights`)
before the KV cache. A sleep reports the device memory still used (`torch.cuda.mem_get_info`: device-wide, so an
upper bound where other processes share the device). Not run on a GPU yet (docs/llm.md).

Fork safety: `preload()` imports torch, vLLM and its engine (one thread: the zygote forks after it). Building the
engine starts gloo's threads (torch.distributed's process group, which vLLM opens even for one worker: 39
threads measured) so a built engine cannot be forked: no template rung (docs/llm.md). The contract validator
defaults `scaling.keep_template` to false for this runtime and refuses true.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import ConfigDict, Field

from ember.errors import Cancelled, ContractInvalid, EmberError, InvalidInput, ModelFailed, ModelNotReady
from ember.runtimes import parse_options
from ember.runtimes.llm_request import check_biases, check_convention, checked_prompt, reply, request_of, token_budget
from ember.runtimes.llm_template import NO_TEMPLATE, TemplateOptions, contract_template, template_tool_format
from ember.runtimes.llm_tools import ToolCalls, ToolFormat, check_schema, check_tools
from ember.runtimes.weights import local_weights
from ember.wire.contract import ModelContract
from ember.wire.generation import Request

if TYPE_CHECKING:
    from ember.runtimes import StopCheck
    from ember.store import WeightStore

# Settings that worked for vLLM's CPU build here (bench/vllm_peer.py): the engine in this process, threads pinned
# by ember (the instance's slice), not by vLLM.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "TQDM_DISABLE": "1"}


class VLLMOptions(TemplateOptions):
    """The contract's `options` for the vllm runtime (and the chat template's: ember.runtimes.llm_template)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    max_model_len: int | None = Field(default=None, ge=16, le=1_048_576)   # default: the model's, at most 8192
    kv_cache_gb: float = Field(default=1.0, gt=0, le=4096)   # the KV pool, GiB (vLLM's kv_cache_memory_bytes)
    default_max_tokens: int = Field(default=512, ge=1, le=1_000_000)
    enforce_eager: bool = True          # no torch.compile (it costs ~70 s at engine build on this CPU)
    prefix_caching: bool = True
    max_num_batched_tokens: int | None = Field(default=None, ge=16, le=1_048_576)
    sleep_mode: Literal["auto", "off"] = "auto"   # auto: vLLM's sleep mode where its platform has it (a GPU)


class VLLMRuntime:
    """Builds vLLM engines for Hugging Face directories."""

    name = "vllm"

    def preload(self) -> None:
        """Imports only (torch, vLLM, its engine, its CPU worker): measured, the process keeps one thread."""
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        import torch  # noqa: F401
        import vllm  # noqa: F401
        from vllm.engine.arg_utils import EngineArgs  # noqa: F401
        from vllm.v1.engine.llm_engine import LLMEngine  # noqa: F401
        from vllm.v1.worker import cpu_worker  # noqa: F401

    def load(self, contract: ModelContract, store: WeightStore | None = None) -> VLLMModel:
        options = parse_options(contract, VLLMOptions)
        check_io(contract)
        template = contract_template(contract, options)   # checked before the engine's long build
        directory = model_dir(contract, store)
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(model=str(directory), dtype=options.dtype, max_model_len=options.max_model_len or
                          _context(directory), enforce_eager=options.enforce_eager,
                          enable_prefix_caching=options.prefix_caching, max_num_seqs=contract.max_concurrency,
                          max_num_batched_tokens=options.max_num_batched_tokens, seed=0,
                          kv_cache_memory_bytes=int(options.kv_cache_gb * (1 << 30)),
                          enable_sleep_mode=can_sleep(options))
        try:
            engine = LLMEngine.from_engine_args(args)
        except EmberError:
            raise
        except Exception as err:   # vLLM's own errors: an architecture it lacks, a KV pool too small, ...
            raise ModelNotReady(f"model '{contract.key}': vLLM cannot build its engine: "
                                f"{type(err).__name__}: {err}") from None
        return VLLMModel(contract, engine, options, template=template)


def can_sleep(options: VLLMOptions) -> bool:
    """vLLM's sleep mode, where the contract allows it and vLLM's platform has it (its CPU build does not)."""
    if options.sleep_mode == "off":
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def device_used_mb() -> float | None:
    """Device memory in use (all processes on the device: an upper bound for one), None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def model_dir(contract: ModelContract, store: WeightStore | None) -> Path:
    """The Hugging Face directory: the contract's own, or the one a `store:` model holds."""
    where = f"model '{contract.key}'"
    if contract.store_ref is not None:
        from ember.runtimes.weights import store_files

        found = sorted(store_files(contract, store, tensors=True).rglob("config.json"))
        if not found:
            raise ModelNotReady(f"{where}: weights {contract.weights!r}: the stored model holds no config.json "
                                "(push the Hugging Face directory with --as-is)")
        return found[0].parent
    directory = local_weights(contract)
    if directory is None:
        raise ContractInvalid(f"{where}: weights: the vllm runtime needs a Hugging Face directory")
    if not (directory / "config.json").is_file():
        raise ModelNotReady(f"{where}: weights: {str(directory)!r} is not a Hugging Face directory "
                            "(no config.json)")
    return directory


def _context(directory: Path) -> int:
    """The model's own context, at most 8192 (vLLM would size its KV checks for the whole of a long one)."""
    import json

    config = json.loads((directory / "config.json").read_text())
    return min(int(config.get("max_position_embeddings") or 8192), 8192)


# A burst of streams reaching an idle engine joins one first step: after its second arrival the first step waits
# until no stream arrived for JOIN_QUIET_S, at most JOIN_MAX_S after the first (the gateway hands 8 streams that a
# client sent at once over ~10 ms). A lone request, or one joining streams already generating, waits for nothing.
JOIN_QUIET_S = 0.005
JOIN_MAX_S = 0.025


def gathering(joins: list[float], now: float) -> bool:
    """Whether an idle engine's first step should wait for more of a burst, given when its requests joined."""
    return len(joins) >= 2 and now - joins[-1] < JOIN_QUIET_S and now - joins[0] < JOIN_MAX_S


def special_token(tokenizer: Any, text: str) -> bool:
    """Whether `text` is one token the tokenizer counts as special (its text dropped by skip_special_tokens)."""
    if not text:
        return False
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids) == 1 and (ids[0] in set(tokenizer.all_special_ids) or
                              tokenizer.decode(ids, skip_special_tokens=True) == "")


MAX_BLANKS = 20   # whitespace characters at one place in constrained JSON


def xgrammar_rules(schema: dict[str, Any], where: str) -> str:
    """EBNF rules (root: `root`) for JSON matching `schema`, from xgrammar, the grammar compiler vLLM runs:
    InvalidInput naming `where` when it cannot be one. Whitespace between JSON's tokens is bounded as
    llama-cpp-python's converter bounds it (20): unbounded, a small model can fill its whole budget with blanks
    (vLLM's own `json` option leaves it unbounded)."""
    import xgrammar

    try:
        return str(xgrammar.Grammar.from_json_schema(json.dumps(schema), max_whitespace_cnt=MAX_BLANKS))
    except (ValueError, RuntimeError, TypeError) as err:   # xgrammar's C++ message, less its time and source line
        reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(err).strip())
        raise InvalidInput(f"{where}: cannot be turned into a grammar: {reason}") from None


def engine_prompt(ids: list[int], tenant: str | None) -> dict[str, Any]:
    """The prompt as the engine takes it: vLLM's prefix cache is scoped by `cache_salt`, so one tenant's cached
    prompts never serve (nor show in `cached_tokens` of) another's; no tenant (authentication off) shares one."""
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if tenant is not None:
        prompt["cache_salt"] = f"tenant:{tenant}"
    return prompt


class VLLMModel:
    """A built engine: `stream({"request": ...})` yields one reply per engine step that brought this stream text.
    Its prefix cache is one tenant's per request (`engine_prompt`): the caller's, else the model's own tenant's."""

    streams = True
    per_tenant = True   # `stream` takes the caller's tenant (ember.runtimes.replies_of)
    warms_in_template = False   # never in a template: the engine's threads forbid forking it

    def __init__(self, contract: ModelContract, engine: Any, options: VLLMOptions,
                 clock: Callable[[], float] = time.monotonic, *, template: str | None = None) -> None:
        """`template`: the contract's chat template (ember.runtimes.llm_template), which replaces the tokenizer's."""
        self.contract, self.engine, self.options, self.clock = contract, engine, options, clock
        self._joins: list[float] = []   # when the requests of a burst joined an idle engine (none yet stepped)
        self.tokenizer = engine.get_tokenizer()
        if template is not None:
            self.tokenizer.chat_template = template   # what apply_chat_template renders from now on
        self.context = int(engine.model_config.max_model_len)
        self.vocab_size = len(self.tokenizer)
        self.tool_format: ToolFormat | None = template_tool_format(options, getattr(self.tokenizer, "chat_template",
                                                                                    None))
        # A format whose call opens with a special token (Mistral's [TOOL_CALLS], some models' <tool_call>): the
        # text must keep special tokens while tools are asked for, or the call would come out as plain text
        # (vLLM's own tool parsers turn skip_special_tokens off for the same reason).
        self._special_open = self.tool_format is not None and special_token(self.tokenizer, self.tool_format.open)
        self._outputs = frozenset(spec.name for spec in contract.outputs)
        self._boxes: dict[str, deque[Any]] = {}
        self._ids = itertools.count()
        self.sleep_levels: tuple[int, ...] = (1, 2) if engine.vllm_config.model_config.enable_sleep_mode else ()
        self._asleep = 0

    # --- sleep mode (ember.node.instance: between requests only) --------------------------------

    def sleep(self, level: int) -> float | None:
        """Level 1: weights to host memory, KV cache dropped; level 2: both discarded. The device MB still used."""
        self.engine.reset_prefix_cache()
        self.engine.sleep(level=level)
        self._asleep = level
        return device_used_mb()

    def wake_up(self) -> None:
        if self._asleep == 2:   # the weights' memory back, the weights read again, then the KV cache
            self.engine.wake_up(tags=["weights"])
            self.engine.collective_rpc("reload_weights")
            self.engine.wake_up(tags=["kv_cache"])
        else:
            self.engine.wake_up()
        self._asleep = 0

    # --- requests -------------------------------------------------------------------------------

    def request_of(self, inputs: Mapping[str, np.ndarray]) -> Request:
        request = request_of(inputs, self.contract)
        check_tools(request, self.tool_format)
        return request

    def prompt_ids(self, request: Request) -> list[int]:
        if request.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidInput(NO_TEMPLATE)
            try:
                text = self.tokenizer.apply_chat_template([m.for_template() for m in request.messages],
                                                          add_generation_prompt=True, tokenize=False,
                                                          tools=list(request.tools) if request.calls_tools else None)
            except Exception as err:   # jinja2's TemplateError, raise_exception in the template
                raise InvalidInput(f"messages: the model's chat template rejects them: {err}") from None
            ids = list(self.tokenizer.encode(str(text), add_special_tokens=False))
        else:
            assert request.prompt is not None
            ids = list(self.tokenizer.encode(request.prompt, add_special_tokens=True))
        return checked_prompt(ids, request, self.context)

    def budget(self, request: Request, prompt_tokens: int) -> int:
        return token_budget(request, prompt_tokens, self.context, self.options.default_max_tokens)

    def sampling(self, request: Request, limit: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        check_biases(request, self.vocab_size)
        return SamplingParams(
            temperature=request.temperature, top_p=request.top_p, max_tokens=limit, stop=list(request.stop) or None,
            seed=None if request.seed is None else request.seed % (1 << 63),
            logit_bias=dict(request.logit_bias) or None, structured_outputs=self.structured(request),
            logprobs=request.top_logprobs if request.logprobs else None, output_kind=RequestOutputKind.DELTA,
            prompt_logprobs=0 if request.echo and request.logprobs else None,
            skip_special_tokens=not (request.calls_tools and self._special_open))

    def structured(self, request: Request) -> Any:
        """vLLM's structured outputs for a request that constrains its output: one call of its tools (`tool_choice`
        `required` or a named function, in the template's format), or JSON (`response_format`); else None."""
        from vllm.sampling_params import StructuredOutputsParams

        choice = request.tool_choice
        if request.calls_tools and (choice == "required" or isinstance(choice, dict)):
            assert self.tool_format is not None   # request_of refused tools without a format
            only = choice["function"]["name"] if isinstance(choice, dict) else None
            call = self.tool_format.call_schema(request.tools, only)
            check_schema(call, "tools")
            return StructuredOutputsParams(grammar=self.tool_format.framed(xgrammar_rules(call, "tools")))
        if request.response_format is None:
            return None
        where = "response_format.json_schema.schema"
        schema = request.response_format.get("schema")
        if schema is None:   # json_object: any object
            schema = {"type": "object"}
        check_schema(schema, where)
        return StructuredOutputsParams(grammar=xgrammar_rules(schema, where))

    # --- generation ---------------------------------------------------------------------------

    def infer(self, inputs: Mapping[str, np.ndarray], stop: StopCheck | None = None) -> dict[str, np.ndarray]:
        """The whole completion as one reply."""
        texts: list[str] = []
        logprobs: list[dict[str, Any]] = []
        last: dict[str, Any] | None = None
        for out in self.generate(self.request_of(inputs), stop):
            if out is None:
                continue
            texts.append(out["text"])
            logprobs.extend(out["logprobs"] or [])
            last = out
        assert last is not None
        return self._reply({**last, "text": "".join(texts), "logprobs": logprobs if last["logprobs"] is not None
                            else None})

    def stream(self, inputs: Mapping[str, np.ndarray], stop: StopCheck | None = None, *,
               tenant: str | None = None) -> Iterator[dict[str, np.ndarray] | None]:
        request = self.request_of(inputs)   # parsed and checked before the first reply
        for out in self.generate(request, stop, tenant=tenant):
            yield None if out is None else self._reply(out)

    def generate(self, request: Request, stop: StopCheck | None = None, *,
                 tenant: str | None = None) -> Iterator[dict[str, Any] | None]:
        """One dict per engine output for this request (text, finish, counts, logprobs); None after a step that
        brought this request nothing, and once after the request joins the engine, before any step: the instance
        server then adds every other request that arrived with it before one of them steps, so they share one
        prefill step (without it each new stream ran a step of its own: 8 streams arriving at once took 8 steps
        to join, 1.5 s before the last one's first token, bench/llm.py --engine vllm). Checks happen before the
        request reaches the engine."""
        ids = self.prompt_ids(request)
        params = self.sampling(request, self.budget(request, len(ids)))
        rid = f"r{next(self._ids)}"
        box: deque[Any] = deque()
        self._boxes[rid] = box
        idle = len(self._boxes) == 1 or bool(self._joins)
        self._add(rid, engine_prompt(ids, tenant if tenant is not None else self.contract.tenant), params, request)
        if idle:
            self._joins.append(self.clock())
        finished, generated = False, 0
        calls = ToolCalls(self.tool_format if request.calls_tools else None,
                          frozenset(t["function"]["name"] for t in request.tools))
        first = True
        try:
            yield None   # before any step: streams that arrived together join the engine's next step together
            while not finished:
                if stop is not None and stop():
                    raise Cancelled(f"model '{self.contract.key}': request stopped")
                if not box and gathering(self._joins, self.clock()):
                    yield None
                    continue
                if not box:
                    self._joins.clear()
                    self._step()
                    if not box:
                        yield None
                        continue
                out = box.popleft()
                generated += len(out.outputs[0].token_ids)
                finished = bool(out.finished)
                yield self._piece(out, request, ids, generated, calls, first)
                first = False
        finally:
            self._boxes.pop(rid, None)
            if not finished:
                self.engine.abort_request([rid])

    def _piece(self, out: Any, request: Request, ids: list[int], generated: int, calls: ToolCalls,
               first: bool) -> dict[str, Any]:
        """One engine output of a request as a reply's fields (text held back or parsed into tool calls; with
        echo, the first leads with the prompt and, with logprobs, the prompt tokens' log-probabilities)."""
        choice, finished = out.outputs[0], bool(out.finished)
        if choice.finish_reason == "abort":
            raise Cancelled(f"model '{self.contract.key}': the engine aborted the request")
        text, tool_calls = calls.finish(choice.text) if finished else (calls.push(choice.text), [])
        logprobs = None
        if request.logprobs:
            logprobs = self._logprobs(choice, request)
            if request.echo and first and out.prompt_logprobs:
                logprobs = [*self._prompt_logprobs(ids, out.prompt_logprobs), *logprobs]
        lead = request.prompt or "" if request.echo and first else ""
        return {"text": lead + text, "prompt_tokens": len(ids), "completion_tokens": generated,
                "finish": "tool_calls" if tool_calls else (choice.finish_reason or "stop") if finished else "",
                "cached_tokens": int(getattr(out, "num_cached_tokens", 0) or 0), "tool_calls": tool_calls,
                "logprobs": logprobs}

    def _prompt_logprobs(self, ids: list[int], given: list[Any]) -> list[dict[str, Any]]:
        """Echo: each prompt token's log-probability after the tokens before it (the first has none)."""
        entries = []
        for token, alternatives in zip(ids, given, strict=False):
            entry = self._entry(token, (alternatives or {}).get(token))
            entries.append({**entry, "logprob": None if alternatives is None else entry["logprob"],
                            "top_logprobs": []})
        return entries

    def _add(self, rid: str, prompt: dict[str, Any], params: Any, request: Request) -> None:
        """The request into the engine; what vLLM refuses of it (a schema its grammar compiler cannot take) is
        InvalidInput naming the field."""
        try:
            self.engine.add_request(rid, prompt, params)
        except ValueError as err:   # vLLM's validation of a request
            self._boxes.pop(rid, None)
            field = ("tools" if request.calls_tools and request.tool_choice != "auto" else
                     "response_format" if request.response_format is not None else "request")
            raise InvalidInput(f"{field}: vLLM refused it: {err}") from None

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:
            raise ModelFailed(f"model '{self.contract.key}': the engine failed: {type(err).__name__}: {err}") from err
        for out in outputs:
            box = self._boxes.get(out.request_id)
            if box is not None:
                box.append(out)

    def _logprobs(self, choice: Any, request: Request) -> list[dict[str, Any]]:
        """OpenAI's chat shape, one entry per token of this output (docs/llm-convention.md)."""
        entries = []
        for token, alternatives in zip(choice.token_ids, choice.logprobs or [], strict=False):
            chosen = alternatives.get(token)
            top = sorted(alternatives.items(), key=lambda kv: kv[1].rank or 0)[: request.top_logprobs]
            entries.append({**self._entry(token, chosen),
                            "top_logprobs": [self._entry(t, lp) for t, lp in top if (lp.rank or 0) >= 1]})
        return entries

    def _entry(self, token: int, logprob: Any) -> dict[str, Any]:
        text = logprob.decoded_token if logprob is not None and logprob.decoded_token is not None else \
            self.tokenizer.decode([token])
        return {"token": text, "logprob": float(logprob.logprob) if logprob is not None else float("-inf"),
                "bytes": list(text.encode("utf-8"))}

    def _reply(self, out: Mapping[str, Any]) -> dict[str, np.ndarray]:
        arrays = reply(out["text"], out["finish"], out["prompt_tokens"], out["completion_tokens"],
                       out["cached_tokens"], out["logprobs"], out.get("tool_calls"))
        return {name: a for name, a in arrays.items() if name in self._outputs}


def check_io(contract: ModelContract) -> None:
    """The contract follows the llm runtime's convention (the same inputs and outputs)."""
    check_convention(contract, "vllm")
