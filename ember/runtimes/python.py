"""The generic `python` runtime: serve a user's own class named by the contract's `entrypoint`.

Contract: `runtime: python`, `entrypoint: "module:Class"` (module may be dotted, e.g. "pkg.model:Model").
The module is imported with the contract file's directory first on `sys.path`, so a contract can sit
next to its code. `weights` (optional) is resolved by `ModelContract.weights_path()` and handed to the
class; `store:NAME[:VERSION]` weights are handed over as the directory the node's weight store
materializes for them (every file, safetensors included). `options` is handed over as a plain dict.

The user class API::

    class Model:
        def __init__(self) -> None: ...                      # no arguments; keep it cheap
        def load(self, weights: pathlib.Path | None, options: dict) -> None: ...
        def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

An `infer` that takes a `stop` keyword gets a callable to check between steps of long work: once it returns
True nobody wants the answer (the client left, the deadline passed) and infer may raise
`ember.errors.Cancelled` (or return early; the answer is dropped).

A class may instead answer with several replies: `stream(self, inputs)` a generator yielding one dict of
outputs per reply (checked like `infer`'s). ember then serves it as a stream (its replies are concatenated
along the first axis for clients that want one answer) and stops the generator when the client leaves.
With `batching.max_batch_size` above 1 in the contract, `infer` gets several requests' rows concatenated
along the first axis and must return one output row per input row.

`inputs` holds one numpy array per contract input, already checked against the contract's names,
datatypes and shapes (BYTES inputs are numpy object arrays of `bytes`). `infer` returns one numpy array
per contract output, under the output's name, with the contract's datatype and rank (BYTES outputs:
object arrays of `bytes`). `load` runs once per process, possibly in a template that is later forked,
so it should load weights (mmap where it can) and not start threads; `infer` may be called many times.

A class whose model can give its memory back while idle (an engine's sleep mode) says so with
`sleep_levels = (1,)`, `(2,)` or `(1, 2)` and methods `sleep(self, level) -> float | None` (the MB it still
holds, or None: its resident memory is counted) and `wake_up(self)`; a contract's `scaling.sleep_after_s`
then puts an idle instance to sleep, and the next request wakes it (rungs `sleep-1`, `sleep-2`).

Errors: an import failure, a missing class or method, or an exception in `__init__`/`load` raises
`ModelNotReady` naming the entrypoint. An exception in `infer` raises `ModelFailed` with the exception's
text (no traceback reaches clients); an `EmberError` raised by `infer` (e.g. `InvalidInput` for a value
the model rejects) passes through unchanged. Outputs that are missing, not numpy arrays, of the wrong
datatype or rank, or not in the contract raise `ModelFailed` naming the output.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.errors import Cancelled, EmberError, ModelFailed, ModelNotReady, OutputMismatch
from ember.runtimes.weights import local_weights, store_files
from ember.wire.contract import ModelContract, TensorSpec
from ember.wire.tensors import datatype_of

if TYPE_CHECKING:
    from ember.runtimes import StopCheck
    from ember.store import WeightStore


class PythonRuntime:
    """Imports `module:Class` from the contract and wraps an instance of it."""

    name = "python"
    sandboxed_load = True   # the user's module and load() run after the sandbox's lock-down (ember.node.loading)

    def preload(self) -> None:
        # Only numpy is common to every python-runtime model; user modules are imported by load().
        import numpy  # noqa: F401

    def load(self, contract: ModelContract, store: WeightStore | None = None) -> PythonModel:
        """Import the entrypoint and load it; store-backed weights come from `store` (the node's weight store)."""
        where = f"model '{contract.key}' entrypoint {contract.entrypoint!r}"
        cls = _import_class(contract, where)
        weights = store_files(contract, store, tensors=True) if contract.store_ref else _resolve_weights(contract)
        try:
            instance = cls()
        except Exception as err:
            raise ModelNotReady(f"{where}: {_describe(err)} in {cls.__name__}()") from None
        if not callable(getattr(instance, "load", None)):
            raise ModelNotReady(f"{where}: class {cls.__name__} has no load() method")
        if not any(callable(getattr(instance, m, None)) for m in ("infer", "stream")):
            raise ModelNotReady(f"{where}: class {cls.__name__} has neither an infer() nor a stream() method")
        try:
            instance.load(weights, dict(contract.options))
        except Exception as err:
            raise ModelNotReady(f"{where}: load() failed: {_describe(err)}") from None
        return PythonModel(contract, instance)


class PythonModel:
    """A loaded user model; `infer` turns the user's failures into ember errors."""

    def __init__(self, contract: ModelContract, instance: Any) -> None:
        self.contract = contract
        self._instance = instance
        self._outputs = {spec.name: spec for spec in contract.outputs}
        self.streams = callable(getattr(instance, "stream", None))
        self._takes_stop = _takes_stop(getattr(instance, "infer", None))
        can_sleep = callable(getattr(instance, "sleep", None)) and callable(getattr(instance, "wake_up", None))
        levels = getattr(instance, "sleep_levels", ())
        # Checked where the instance offers them (ember.node.instance.model_sleep_levels): only 1 and 2 count.
        self.sleep_levels: tuple[int, ...] = tuple(levels) if can_sleep and isinstance(levels, tuple | list) else ()

    def sleep(self, level: int) -> float | None:
        held = self._call("sleep", level)
        return float(held) if isinstance(held, int | float) and not isinstance(held, bool) else None

    def wake_up(self) -> None:
        self._call("wake_up")

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._instance, method)(*args)
        except EmberError:
            raise
        except Exception as err:
            raise ModelFailed(f"model '{self.contract.key}': {method}() failed: {_describe(err)}") from None

    def infer(self, inputs: Mapping[str, np.ndarray], stop: StopCheck | None = None) -> dict[str, np.ndarray]:
        if self.streams and not callable(getattr(self._instance, "infer", None)):
            raise ModelFailed(f"model '{self.contract.key}' streams its replies: it has no single-reply infer()")
        try:
            if self._takes_stop:
                outputs = self._instance.infer(dict(inputs), stop=stop or _never)
            else:
                outputs = self._instance.infer(dict(inputs))
        except EmberError:
            raise
        except Exception as err:
            raise ModelFailed(f"model '{self.contract.key}': infer() failed: {_describe(err)}") from None
        return self._check_outputs(outputs)

    def stream(self, inputs: Mapping[str, np.ndarray],
               stop: StopCheck | None = None) -> Iterator[dict[str, np.ndarray]]:
        """The user's generator, each reply checked; closed (its `finally` runs) when `stop` says so."""
        try:
            replies = iter(self._instance.stream(dict(inputs)))
        except EmberError:
            raise
        except Exception as err:
            raise ModelFailed(f"model '{self.contract.key}': stream() failed: {_describe(err)}") from None
        try:
            while True:
                if stop is not None and stop():
                    raise Cancelled(f"model '{self.contract.key}': stream stopped")
                try:
                    outputs = next(replies)
                except StopIteration:
                    return
                except EmberError:
                    raise
                except Exception as err:
                    raise ModelFailed(f"model '{self.contract.key}': stream() failed: {_describe(err)}") from None
                yield self._check_outputs(outputs)
        finally:
            close = getattr(replies, "close", None)
            if callable(close):
                close()

    def _check_outputs(self, outputs: object) -> dict[str, np.ndarray]:
        key = self.contract.key
        if not isinstance(outputs, Mapping):
            raise ModelFailed(f"model '{key}': infer() returned {type(outputs).__name__}, not a dict of outputs")
        for name in outputs:
            if name not in self._outputs:
                raise ModelFailed(f"model '{key}': output '{name}' is not in the contract")
        checked: dict[str, np.ndarray] = {}
        for name, spec in self._outputs.items():
            if name not in outputs:
                raise ModelFailed(f"model '{key}': output '{name}' is missing")
            checked[name] = _check_output(key, spec, outputs[name])
        return checked


def _never() -> bool:
    return False


def _takes_stop(method: object) -> bool:
    """Whether the user's infer() accepts `stop` (a check to call between steps of long work)."""
    if not callable(method):
        return False
    try:
        return "stop" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def _check_output(key: str, spec: TensorSpec, value: object) -> np.ndarray:
    where = f"model '{key}': output '{spec.name}'"
    if not isinstance(value, np.ndarray):
        raise ModelFailed(f"{where}: expected a numpy array, got {type(value).__name__}")
    try:
        got = datatype_of(value)
    except EmberError:
        got = str(value.dtype)
    if got != spec.datatype:
        raise OutputMismatch(f"{where}: datatype {got} does not match the contract's {spec.datatype}")
    if value.ndim != len(spec.shape) or any(s not in (-1, d) for s, d in zip(spec.shape, value.shape, strict=True)):
        raise OutputMismatch(f"{where}: shape {list(value.shape)} does not match the contract's {list(spec.shape)}")
    return value


def _import_class(contract: ModelContract, where: str) -> type:
    if not contract.entrypoint or ":" not in contract.entrypoint:
        raise ModelNotReady(f"{where}: entrypoint must look like 'module:Class'")
    module_name, _, class_name = contract.entrypoint.partition(":")
    base = Path(contract.source).resolve().parent if contract.source else None
    if base is not None:
        _put_first_on_path(base)
        _forget_shadowed(module_name, base)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise ModelNotReady(f"{where}: cannot import module {module_name!r}: {_describe(err)}") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ModelNotReady(f"{where}: module {module_name!r} has no class {class_name!r}")
    return cls


def _put_first_on_path(base: Path) -> None:
    entry = str(base)
    if entry in sys.path:
        sys.path.remove(entry)
    sys.path.insert(0, entry)
    importlib.invalidate_caches()


def _forget_shadowed(module_name: str, base: Path) -> None:
    """Drop an already-imported module of the same name that lives elsewhere.

    Two contracts in different directories may both name `model:Model`; in one process (a test, or a
    node that loads several python models) the second must get its own file, not the first one's.
    Only modules this directory provides are dropped, so installed packages are never re-imported.
    """
    top = module_name.split(".")[0]
    if not ((base / f"{top}.py").is_file() or (base / top).is_dir()):
        return
    loaded = sys.modules.get(top)
    origin = getattr(loaded, "__file__", None)
    if loaded is None or (origin is not None and Path(origin).resolve().is_relative_to(base)):
        return
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]


def _resolve_weights(contract: ModelContract) -> Path | None:
    path = local_weights(contract)
    if path is not None and not path.exists():
        raise ModelNotReady(f"model '{contract.key}': weights file {str(path)!r} does not exist")
    return path


def _describe(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
