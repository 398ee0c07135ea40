"""Triton's model configuration extension: a model's configuration in Triton's JSON shape (`model_config.proto`),
built from its contract. `GET /v2/models/{m}[/versions/{v}]/config` answers it, and the gRPC `ModelConfig` the
same, as a message.

- `max_batch_size`: when every input and output starts with a -1 (batch) axis, the rows one request may carry
  (`limits.max_batch_rows`), and each tensor's `dims` leave that axis out (a tensor with no other axis is
  `dims: [1]` with `reshape: {shape: []}`, as Triton writes one value per row); otherwise 0, `dims` the whole shape.
- `data_type`: `TYPE_` and the V2 datatype (`TYPE_FP32`); BYTES is Triton's `TYPE_STRING`.
- `dynamic_batching` when the model runs several requests in one pass (`batching`), `instance_group` its most
  instances (`scaling.max_scale`) on the slice's kind. An llm or vllm model is not `decoupled`: a unary infer gets
  its whole text in one row, and a stream (ModelStreamInfer, generate_stream) its replies as they come; a client that
  reads `decoupled: true` would refuse the unary call (perf_analyzer does).
"""

from __future__ import annotations

from typing import Any

from ember.wire.contract import ModelContract, TensorSpec


def data_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def batched(contract: ModelContract) -> bool:
    """Whether every tensor has a leading batch axis (Triton's max_batch_size > 0)."""
    return all(t.shape[0] == -1 for t in (*contract.inputs, *contract.outputs))


def _tensor(spec: TensorSpec, in_batch: bool) -> dict[str, Any]:
    dims = list(spec.shape[1:] if in_batch else spec.shape)
    out: dict[str, Any] = {"name": spec.name, "data_type": data_type(spec.datatype), "dims": dims or [1]}
    if not dims:
        out["reshape"] = {"shape": []}
    return out


def triton_config(contract: ModelContract) -> dict[str, Any]:
    """The contract as Triton's ModelConfig, in the JSON Triton's HTTP API answers."""
    in_batch = batched(contract)
    config: dict[str, Any] = {
        "name": contract.name,
        "platform": contract.runtime,
        "backend": contract.runtime,
        "max_batch_size": contract.limits.max_batch_rows if in_batch else 0,
        "input": [_tensor(t, in_batch) for t in contract.inputs],
        "output": [_tensor(t, in_batch) for t in contract.outputs],
        "instance_group": [{"name": contract.name, "count": contract.scaling.max_scale,
                            "kind": "KIND_CPU" if contract.resources.slice == "cpu" else "KIND_GPU"}],
    }
    if contract.max_batch_size > 1:
        config["dynamic_batching"] = {"preferred_batch_size": list(contract.batching.preferred_batch_size),
                                      "max_queue_delay_microseconds": contract.batching.max_queue_delay_us}
    return config
