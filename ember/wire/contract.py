"""The model contract: one YAML file per model, validated once when it is loaded.

A contract says what a model is (name, version, runtime, weights), what it takes and
returns (V2 tensor metadata, used to validate every request), what it needs (a slice
kind and memory) and how ember should keep it (scaling, warmup).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ember.errors import ContractInvalid, InvalidInput
from ember.wire.refs import NAME_PATTERN, ModelRef

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]

_NAME_PATTERN = NAME_PATTERN

# The runtimes a node can load (ember.runtimes.get_runtime); a typo fails when the contract loads, naming the key.
RuntimeName = Literal["sentence-transformers", "python", "llm", "vllm"]
# Runtimes that run in an environment of their own (`ember env build NAME`), not ember's: its interpreter runs their
# zygote, templates and instances. The others run in ember's own.
RUNTIME_ENVIRONMENTS = {"vllm": "vllm"}
NO_TEMPLATE = frozenset({"vllm"})   # runtimes whose loaded model cannot be forked: scaling.keep_template is false
STORE_PREFIX = "store:"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(_Strict):
    """V2 tensor metadata; -1 in `shape` means any size on that axis."""

    name: str = Field(pattern=_NAME_PATTERN, description="the tensor's name, as requests and replies give it")
    datatype: Datatype = Field(description="the V2 datatype of its elements")
    shape: tuple[int, ...] = Field(description="its dimensions, at least one: each a positive size, or -1 for any "
                                               "size on that axis")

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if not shape:
            raise ValueError("shape needs at least one dimension")
        if any(d < -1 or d == 0 for d in shape):
            raise ValueError("each dimension is a positive size or -1 (any)")
        return shape


class Resources(_Strict):
    slice: str = Field(default="cpu", description="slice kind: 'cpu' or a GPU profile like 'mig-1g.18gb'")
    memory_mb: int = Field(default=1024, ge=16, le=1_048_576, description=(
        "memory of each template and instance: its memory cgroup, and what a slice must have free to start one"))
    cpu_weight: int = Field(default=100, ge=1, le=10_000, description=(
        "its instances' share of contended cores against other models' (cgroup cpu.weight; 100 is everyone's "
        "default)"))
    cpu_max: float | None = Field(default=None, gt=0, le=4096, description=(
        "the most cores each instance may use, as a quota (cgroup cpu.max; default: no cap)"))
    dedicated_cores: bool = Field(default=False, description=(
        "run each instance on a dedicated CPU slot of its own (the node's --dedicated-cpu-slots) instead of the "
        "cores every other model shares"))

    @model_validator(mode="after")
    def _dedicated_on_cpu(self) -> Resources:
        if self.dedicated_cores and self.slice != "cpu":
            raise ValueError(f"dedicated_cores: only for slice 'cpu' (a {self.slice!r} slice is an instance's own "
                             "already)")
        return self


class Sandbox(_Strict):
    """How its instances are closed in (ember/node/sandbox.py); the server's `--sandbox off` turns it off for all."""

    enabled: bool = Field(default=True, description="run instances sandboxed: own user, memory cgroup, "
                                                    "read-only files, seccomp")
    network: bool = Field(default=False, description="keep the network (default: an empty network namespace)")
    pids: int = Field(default=128, ge=8, le=32_768, description="most tasks (processes and threads) at once in each "
                                                                "template and instance (a pids cgroup)")


class Scaling(_Strict):
    min_scale: int = Field(default=0, ge=0, le=1000, description=(
        "instances kept up whatever the load (in a cluster: across it, shared among the nodes serving the model)"))
    max_scale: int = Field(default=4, ge=1, le=1000, description="most instances of the model at once")
    initial_scale: int | None = Field(default=None, ge=0, le=1000, description="default: min_scale")
    target_concurrency: float = Field(default=1.0, gt=0, le=1000,
                                      description="requests in flight per instance the autoscaler aims at")
    pause_after_s: float = Field(default=2.0, ge=0, le=86_400, description="idle time before SIGSTOP")
    max_idle_s: float = Field(default=300.0, gt=0, le=604_800, description="idle time before recycling")
    sleep_after_s: float | None = Field(
        default=None, ge=0, le=604_800,
        description="idle time before an instance whose engine can sleep (vLLM's sleep mode, on a GPU) is put to "
                    "sleep, giving its device memory back (default: never)")
    sleep_level: Literal[1, 2] = Field(
        default=1, description="1: weights kept in host memory; 2: discarded, read again on wake")
    keep_template: bool = Field(default=True, description=(
        "keep a template (the model loaded, forking replicas) for the template rung; a runtime that cannot fork a "
        "loaded model (vllm) refuses true"))
    max_concurrency: int | None = Field(
        default=None, ge=1, le=4096,
        description="requests one instance holds at once (default: twice the batch size when batching, "
                    "else target_concurrency)")

    @model_validator(mode="after")
    def _bounds(self) -> Scaling:
        if self.min_scale > self.max_scale:
            raise ValueError(f"min_scale ({self.min_scale}) exceeds max_scale ({self.max_scale})")
        if self.initial_scale is not None and not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError("initial_scale must lie between min_scale and max_scale")
        if self.pause_after_s > self.max_idle_s:
            raise ValueError("pause_after_s must not exceed max_idle_s")
        if self.sleep_after_s is not None and self.sleep_after_s > self.max_idle_s:
            raise ValueError("sleep_after_s must not exceed max_idle_s")
        return self


class Batching(_Strict):
    """Dynamic batching (Triton's): concurrent requests coalesced into one forward pass along axis 0."""

    max_batch_size: int | None = Field(
        default=None, ge=1, le=4096,
        description="rows per forward pass; 1 turns batching off (default: 32 for runtimes that batch, "
                    "sentence-transformers, else 1)")
    max_queue_delay_us: int = Field(default=2000, ge=0, le=1_000_000,
                                    description="longest a request waits for others to join its batch")
    preferred_batch_size: tuple[int, ...] = Field(
        default=(), description="sizes that run at once (default: learned from how many requests come together)")

    @field_validator("preferred_batch_size")
    @classmethod
    def _positive(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        if any(size < 1 for size in sizes):
            raise ValueError("each preferred batch size is a positive number of rows")
        return tuple(sorted(set(sizes)))


# Runtimes whose models take any number of rows per call batch by default; others only when asked to.
_DEFAULT_BATCH = {"sentence-transformers": 32}


class Warmup(_Strict):
    requests: int = Field(default=3, ge=0, le=100, description=(
        "requests each template and instance answers before it is READY"))
    inputs: dict[str, tuple[str | int | float | bool, ...]] | None = Field(
        default=None,
        description="the warmup request's values per input name, flattened row-major (BYTES: strings, sent as "
                    "UTF-8); inputs left out get dummy values (zeros, a short sentence)")


class Limits(_Strict):
    """What one request may cost, checked at the edge (the gateway, and again by the instance) before any work:
    a client cannot make a request dearer than its contract allows, whatever the body limit."""

    max_batch_rows: int = Field(default=4096, ge=1, le=1_000_000,
                                description="rows (the first axis) of each input of one request")
    max_string_bytes: int = Field(default=1 << 20, ge=1, le=1 << 30,
                                  description="bytes of one element of a BYTES input")
    max_tokens: int = Field(default=32768, ge=1, le=10_000_000,
                            description="tokens one generation request may ask for (llm runtime: max_tokens)")
    request_timeout_s: float | None = Field(
        default=None, gt=0, le=86_400,
        description="seconds one request may take, from its arrival to its last reply (a stream's last token); "
                    "default: the server's --request-timeout-s")

    def timeout_s(self, server_timeout_s: float) -> float:
        """How long one request may take: `request_timeout_s`, else the server's."""
        return self.request_timeout_s or server_timeout_s


class ModelContract(_Strict):
    """A deployable model. `key` ("name:version") identifies it everywhere in ember."""

    name: str = Field(pattern=_NAME_PATTERN, description="the model's name in every API")
    version: str = Field(default="1", pattern=_NAME_PATTERN, description=(
        "its version: `name:version` identifies the model (a contract with a bundled example's replaces it)"))
    tenant: str | None = Field(
        default=None, pattern=_NAME_PATTERN,
        description="the tenant whose API keys may see and call the model (admins see every model); "
                    "without it the model is public: every tenant sees it")
    runtime: RuntimeName = Field(description="'sentence-transformers', 'python', 'llm' or 'vllm'")
    environment: str | None = Field(
        default=None, pattern=_NAME_PATTERN,
        description="the node environment whose interpreter runs the model (`ember env build NAME`); default: "
                    "the runtime's own ('vllm' for the vllm runtime, ember's for the others)")
    weights: str | None = Field(
        default=None,
        description="a directory or file: absolute, relative to the contract, pkg:MODULE/sub/path, "
                    "or store:NAME[:VERSION] (a model in the node's weight store)",
    )
    entrypoint: str | None = Field(default=None, description="'module:Class' for the python runtime")
    inputs: tuple[TensorSpec, ...] = Field(min_length=1, description="the tensors a request carries; every request "
                                                                     "is checked against them")
    outputs: tuple[TensorSpec, ...] = Field(min_length=1, description="the tensors a reply carries")
    resources: Resources = Resources()
    scaling: Scaling = Scaling()
    warmup: Warmup = Warmup()
    batching: Batching = Batching()
    limits: Limits = Limits()
    sandbox: Sandbox = Sandbox()
    idempotent: bool = Field(default=False, strict=True, description=(
        "running a request twice does no harm (no side effects): in a cluster, a forwarded request whose node was "
        "lost after the request reached it is run again on another node; otherwise only a request that never "
        "reached its node is (docs/cluster.md)"))
    options: dict[str, Any] = Field(default_factory=dict, description="runtime-specific settings")
    source: str | None = Field(default=None, description="the file it was read from (set by the loader)")
    bundle: str | None = Field(default=None, description=(
        "the weight store's NAME:VERSION of the contract directory it was read from (set by the loader): "
        "another node writes that directory out of its own store rather than reading `source`"))

    @property
    def key(self) -> str:
        return f"{self.name}:{self.version}"

    @field_validator("weights")
    @classmethod
    def _store_name(cls, weights: str | None) -> str | None:
        if weights is not None and weights.startswith(STORE_PREFIX):
            try:
                ModelRef.parse(weights[len(STORE_PREFIX):])
            except InvalidInput as err:
                raise ValueError(f"{weights!r} is not a weight store name: {err.message}") from None
        return weights

    @property
    def store_ref(self) -> str | None:
        """The weight store's `name:version` of the model's weights (None unless `weights` is store:...)."""
        if self.weights is None or not self.weights.startswith(STORE_PREFIX):
            return None
        return ModelRef.parse(self.weights[len(STORE_PREFIX):]).key

    @property
    def environment_name(self) -> str | None:
        """The environment the model runs in (None: ember's own)."""
        return self.environment or RUNTIME_ENVIRONMENTS.get(self.runtime)

    @model_validator(mode="before")
    @classmethod
    def _no_template(cls, data: Any) -> Any:
        """Runtimes whose loaded model cannot be forked (vllm: its engine's threads) keep no template."""
        if not isinstance(data, dict) or data.get("runtime") not in NO_TEMPLATE:
            return data
        scaling = data.get("scaling")
        if scaling is None or (isinstance(scaling, dict) and "keep_template" not in scaling):
            return {**data, "scaling": {**(scaling or {}), "keep_template": False}}
        if isinstance(scaling, dict) and scaling["keep_template"] is True:
            raise ValueError(f"scaling.keep_template: runtime {data['runtime']!r} cannot fork a loaded model "
                             "(no template rung; docs/llm.md says why)")
        return data

    @model_validator(mode="after")
    def _environment(self) -> ModelContract:
        own = RUNTIME_ENVIRONMENTS.get(self.runtime)
        if self.environment is not None and self.environment != own:
            where = f"environment {own!r}" if own else "ember's own environment"
            raise ValueError(f"environment: runtime {self.runtime!r} runs in {where}, not {self.environment!r}")
        return self

    @model_validator(mode="after")
    def _entrypoint(self) -> ModelContract:
        if self.runtime == "python" and not self.entrypoint:
            raise ValueError("the python runtime needs entrypoint: 'module:Class'")
        if self.entrypoint is not None and ":" not in self.entrypoint:
            raise ValueError("entrypoint must look like 'module:Class'")
        names = [t.name for t in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError("input names must be unique")
        for name, values in (self.warmup.inputs or {}).items():
            _check_warmup_values(self.input(name), name, values)
        if self.batching.max_batch_size is not None and self.batching.max_batch_size > 1:
            fixed = [t.name for t in (*self.inputs, *self.outputs) if t.shape[0] != -1]
            if fixed:
                raise ValueError(f"batching.max_batch_size: batching needs every input and output to start with "
                                 f"a -1 (batch) axis; {fixed[0]!r} does not")
        if self.batching.preferred_batch_size and max(self.batching.preferred_batch_size) > self.max_batch_size:
            raise ValueError(f"batching.preferred_batch_size: sizes must not exceed max_batch_size "
                             f"({self.max_batch_size})")
        return self

    @property
    def max_batch_size(self) -> int:
        """Rows an instance runs in one forward pass (1: requests run one by one)."""
        if self.batching.max_batch_size is not None:
            return self.batching.max_batch_size
        return _DEFAULT_BATCH.get(self.runtime, 1)

    @property
    def max_concurrency(self) -> int:
        """Requests one instance holds at once: room for a batch running and the next one filling."""
        if self.scaling.max_concurrency is not None:
            return self.scaling.max_concurrency
        if self.max_batch_size > 1:
            return 2 * self.max_batch_size
        return max(1, int(self.scaling.target_concurrency))

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def weights_path(self) -> Path | None:
        """Resolve `weights` to a local path; None without weights.

        Store-backed weights have no path of their own: the store materializes them (see `store_ref`), so
        asking for their path is a ContractInvalid that says so rather than a path that does not exist.
        """
        if self.weights is None:
            return None
        if self.store_ref is not None:
            raise ContractInvalid(f"weights: {self.weights!r} lives in the weight store, not at a path "
                                  "(open it through the store)")
        if self.weights.startswith("pkg:"):
            module, _, sub = self.weights[4:].partition("/")
            spec = importlib.util.find_spec(module)
            if spec is None or not spec.submodule_search_locations:
                raise ContractInvalid(f"weights: package {module!r} is not installed")
            return Path(next(iter(spec.submodule_search_locations))) / sub
        path = Path(self.weights)
        if not path.is_absolute() and self.source:
            path = Path(self.source).parent / path
        return path


def warmup_shape(spec: TensorSpec, count: int) -> tuple[int, ...] | None:
    """The shape `count` warmup values fill for `spec`: its first -1 axis takes up the slack, other -1 axes are 1
    (None: the values cannot fill it)."""
    shape = [1 if d == -1 else d for d in spec.shape]
    fixed = 1
    for d in shape:
        fixed *= d
    if -1 in spec.shape and count > 0 and count % fixed == 0:
        shape[spec.shape.index(-1)] = count // fixed
        return tuple(shape)
    return tuple(shape) if count == fixed else None


def _check_warmup_values(spec: TensorSpec | None, name: str, values: tuple[str | int | float | bool, ...]) -> None:
    if spec is None:
        raise ValueError(f"warmup.inputs: {name!r} is not an input of this model")
    if spec.datatype == "BYTES" and not all(isinstance(v, str) for v in values):
        raise ValueError(f"warmup.inputs.{name}: a BYTES input's values are strings")
    if spec.datatype != "BYTES" and any(isinstance(v, str) for v in values):
        raise ValueError(f"warmup.inputs.{name}: a {spec.datatype} input's values are numbers")
    if warmup_shape(spec, len(values)) is None:
        raise ValueError(f"warmup.inputs.{name}: {len(values)} values do not fill shape {list(spec.shape)}")


# The tags pydantic adds to a location for each member of a union of plain types (`str | int | ...`).
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "none"})
_VALID = "Input should be a valid "


def _format_error(err: ValidationError, where: str) -> str:
    """One message per bad key. pydantic adds noise to the cause: the enclosing tuple too short "after
    validation" when an item failed, and one error per member of a union; both go."""
    errors = [(tuple(e["loc"]), e["msg"]) for e in err.errors()]
    locs = {loc for loc, _ in errors}
    merged: dict[tuple[Any, ...], list[str]] = {}
    for loc, msg in errors:
        if any(other[:len(loc)] == loc and other != loc for other in locs):
            continue   # an enclosing key failing because something inside it did: the inner error says why
        if len(loc) > 1 and loc[-1] in _UNION_TAGS:
            loc = loc[:-1]
        merged.setdefault(loc, []).append(msg)
    parts = [f"{'.'.join(str(p) for p in loc) or '(contract)'}: {_either(msgs)}" for loc, msgs in merged.items()]
    return f"{where}: invalid model contract: " + "; ".join(parts)


def _either(msgs: list[str]) -> str:
    """"Input should be a valid string, integer or boolean" from one message per union member."""
    if len(msgs) == 1:
        return msgs[0]
    if all(m.startswith(_VALID) for m in msgs):
        kinds = [m[len(_VALID):] for m in msgs]
        return _VALID + ", ".join(kinds[:-1]) + " or " + kinds[-1]
    return " or ".join(msgs)


def parse_contract(data: Any, source: str | None = None) -> ModelContract:
    """Validate a mapping into a contract; raise ContractInvalid naming each bad key."""
    where = source or "contract"
    if not isinstance(data, dict):
        raise ContractInvalid(f"{where}: a model contract is a mapping, got {type(data).__name__}")
    if source is not None:
        data = {**data, "source": source}
    try:
        return ModelContract.model_validate(data)
    except ValidationError as err:
        raise ContractInvalid(_format_error(err, where)) from None


def load_contract(path: str | Path) -> ModelContract:
    """Read and validate one contract file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ContractInvalid(f"{path}: cannot read model contract: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ContractInvalid(f"{path}: not valid YAML: {err}") from None
    return parse_contract(data, source=str(path.resolve()))


def find_contracts(path: str | Path) -> list[Path]:
    """A contract file, or every *.yaml / *.yml directly inside a directory."""
    path = Path(path)
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
    return [path]


def example_contracts_dir() -> Path:
    """The bundled examples (the MiniLM embedder, a tiny python-runtime model and the SmolLM2 chat model)."""
    return Path(__file__).resolve().parent.parent / "examples"
