"""KServe V2 gRPC messages <-> tensors: a `ModelInferRequest`'s inputs (in `raw_input_contents`, or typed in each
input's `contents`) to ember's tensors, checked as the HTTP codec checks a body (every error names the input or the
field), and outputs to a `ModelInferResponse` whose tensors travel in `raw_output_contents`, as Triton answers.

Raw contents are the V2 binary layout (`ember.wire.tensors`): one entry per input, in input order, for every input
or none. Typed contents hold each datatype in its own field (FP16 has none: raw only); the integer fields are wider
than INT8/INT16 and UINT8/UINT16, whose values are checked to fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from ember.errors import InvalidInput, ModelFailed
from ember.wire.contract import ModelContract
from ember.wire.grpc import grpc_service_pb2 as pb
from ember.wire.tensors import NUMPY_OF, Tensors, check_shape, datatype_of, from_raw, to_raw

# Each datatype's typed contents field (InferTensorContents) and the numpy type its values arrive in.
CONTENTS_OF: dict[str, tuple[str, np.dtype]] = {
    "BOOL": ("bool_contents", np.dtype(np.bool_)),
    "INT8": ("int_contents", np.dtype(np.int32)), "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)), "INT64": ("int64_contents", np.dtype(np.int64)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)), "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)), "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)), "FP64": ("fp64_contents", np.dtype(np.float64)),
    "BYTES": ("bytes_contents", np.dtype(object)),
}
# A request parameter Triton defines: after a stream request's last response, one more, empty, that says so.
FINAL_RESPONSE_WANTED = "triton_enable_empty_final_response"
FINAL_RESPONSE = "triton_final_response"


@dataclass(frozen=True)
class GrpcInfer:
    request_id: str
    inputs: Tensors
    outputs: tuple[str, ...] | None   # None: every output the model returns
    final_response: bool              # the client asked for an empty last response on a stream


def parse_message(raw: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(raw)
    except DecodeError as err:
        raise InvalidInput(f"ModelInferRequest: not a valid protobuf message ({err})") from None


def decode_infer(message: pb.ModelInferRequest, contract: ModelContract) -> GrpcInfer:
    """The request's tensors and requested outputs; InvalidInput naming the field at the first fault."""
    raw = message.raw_input_contents
    if not message.inputs:
        raise InvalidInput("inputs: the request has none")
    if raw and len(raw) != len(message.inputs):
        raise InvalidInput(f"raw_input_contents: {len(raw)} entries for {len(message.inputs)} inputs (one per input, "
                           "in input order, or none)")
    inputs: Tensors = {}
    for i, spec in enumerate(message.inputs):
        if not spec.name:
            raise InvalidInput(f"inputs[{i}].name: missing")
        if spec.name in inputs:
            raise InvalidInput(f"input '{spec.name}': given more than once")
        shape = check_shape(tuple(spec.shape), spec.name)
        if not raw:
            inputs[spec.name] = _typed(spec, shape)
        elif spec.HasField("contents"):
            raise InvalidInput(f"input '{spec.name}': has both contents and raw_input_contents[{i}]")
        else:
            inputs[spec.name] = from_raw(raw[i], spec.datatype, shape, spec.name)
    return GrpcInfer(message.id, inputs, _requested(message, contract), _flag(message, FINAL_RESPONSE_WANTED))


def _typed(spec: pb.ModelInferRequest.InferInputTensor, shape: tuple[int, ...]) -> np.ndarray:
    name, datatype = spec.name, spec.datatype
    if datatype not in NUMPY_OF:
        raise InvalidInput(f"input '{name}': unknown datatype {datatype!r}")
    if datatype not in CONTENTS_OF:
        raise InvalidInput(f"input '{name}': {datatype} has no typed contents; send it in raw_input_contents")
    field, wire = CONTENTS_OF[datatype]
    other = next((f.name for f, _ in spec.contents.ListFields() if f.name != field), None)
    if other is not None:
        raise InvalidInput(f"input '{name}': contents.{other} does not hold {datatype} (send contents.{field})")
    values = getattr(spec.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidInput(f"input '{name}': shape {list(shape)} needs {count} elements, contents.{field} "
                           f"has {len(values)}")
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    array = np.array(values, dtype=wire)
    dtype = NUMPY_OF[datatype]
    if dtype != wire and array.size:
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidInput(f"input '{name}': a value of contents.{field} lies outside the range of {datatype}")
    return array.astype(dtype, copy=False).reshape(shape)


def _requested(message: pb.ModelInferRequest, contract: ModelContract) -> tuple[str, ...] | None:
    if not message.outputs:
        return None
    names = [spec.name for spec in contract.outputs]
    chosen: list[str] = []
    for out in message.outputs:
        if out.name not in names:
            raise InvalidInput(f"output '{out.name}': model '{contract.name}' has no such output "
                               f"(has {', '.join(names)})")
        if out.name in chosen:
            raise InvalidInput(f"output '{out.name}': requested more than once")
        if "classification" in out.parameters:
            raise InvalidInput(f"output '{out.name}': the classification extension is not supported")
        chosen.append(out.name)
    return tuple(chosen)


def _flag(message: pb.ModelInferRequest, key: str) -> bool:
    if key not in message.parameters:
        return False
    param = message.parameters[key]
    if param.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidInput(f"parameters.{key}: must be a bool_param")
    return param.bool_param


def infer_response(contract: ModelContract, parsed: GrpcInfer, outputs: Tensors,
                   parameters: dict[str, str] | None = None) -> pb.ModelInferResponse:
    """The outputs asked for (all the model returned when none were), each in `raw_output_contents`."""
    response = pb.ModelInferResponse(model_name=contract.name, model_version=contract.version, id=parsed.request_id)
    for name in parsed.outputs or outputs:
        if name not in outputs:
            raise ModelFailed(f"model '{contract.key}': returned no output '{name}'")
        array = outputs[name]
        response.outputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
        response.raw_output_contents.append(to_raw(array))
    for key, value in (parameters or {}).items():
        response.parameters[key].string_param = value
    return response


def encode_infer(contract: ModelContract, parsed: GrpcInfer, outputs: Tensors, parameters: dict[str, str]) -> bytes:
    return infer_response(contract, parsed, outputs, parameters).SerializeToString()


def encode_stream_reply(contract: ModelContract, parsed: GrpcInfer, outputs: Tensors,
                        parameters: dict[str, str] | None = None) -> bytes:
    reply = infer_response(contract, parsed, outputs, parameters)
    return pb.ModelStreamInferResponse(infer_response=reply).SerializeToString()


def encode_stream_end(contract: ModelContract, parsed: GrpcInfer) -> bytes:
    """The empty response that ends a request's replies on a stream (when the client asked for one)."""
    reply = pb.ModelInferResponse(model_name=contract.name, model_version=contract.version, id=parsed.request_id)
    reply.parameters[FINAL_RESPONSE].bool_param = True
    return pb.ModelStreamInferResponse(infer_response=reply).SerializeToString()


def encode_stream_error(message: str) -> bytes:
    """An error on a stream: in-band, as Triton sends it, so that the stream's other requests go on."""
    return pb.ModelStreamInferResponse(error_message=message).SerializeToString()
