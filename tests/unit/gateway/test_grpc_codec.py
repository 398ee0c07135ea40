"""The gRPC binding's codec (ModelInferRequest -> tensors -> ModelInferResponse), its error table and the gRPC port's
settings."""

from __future__ import annotations

import numpy as np
import pytest

import ember.errors as errors
from ember.config import load_serve_config
from ember.errors import EmberError, InvalidInput
from ember.gateway.grpc_api import GRPC_CODE_OF, grpc_code
from ember.gateway.grpc_codec import decode_infer, infer_response, parse_message
from ember.wire.contract import parse_contract
from ember.wire.grpc import grpc_service_pb2 as pb
from ember.wire.tensors import to_raw

CONTRACT = parse_contract({
    "name": "m", "runtime": "python", "entrypoint": "x:Y",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}, {"name": "small", "datatype": "INT8",
                                                                      "shape": [-1]},
               {"name": "text", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}, {"name": "z", "datatype": "BYTES", "shape": [-1]}],
})


def request(**inputs: dict[str, object]) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m", id="r-1")
    for name, spec in inputs.items():
        message.inputs.add(name=name, **spec)
    return message


def test_raw_and_typed_contents_decode_to_the_same_tensors() -> None:
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    texts = np.array([b"a", "\u00e9".encode()], dtype=object)
    raw = request(x={"datatype": "FP32", "shape": [2, 2]}, text={"datatype": "BYTES", "shape": [2]})
    raw.raw_input_contents.extend([to_raw(x), to_raw(texts)])
    typed = request(x={"datatype": "FP32", "shape": [2, 2], "contents": {"fp32_contents": x.ravel().tolist()}},
                    small={"datatype": "INT8", "shape": [2], "contents": {"int_contents": [-128, 127]}},
                    text={"datatype": "BYTES", "shape": [2], "contents": {"bytes_contents": list(texts)}})
    for message in (raw, typed):
        parsed = decode_infer(parse_message(message.SerializeToString()), CONTRACT)
        assert np.array_equal(parsed.inputs["x"], x) and list(parsed.inputs["text"]) == list(texts)
        assert parsed.request_id == "r-1" and parsed.outputs is None and not parsed.final_response
    assert parsed.inputs["small"].dtype == np.int8 and list(parsed.inputs["small"]) == [-128, 127]


@pytest.mark.parametrize(("message", "says"), [
    (request(), "inputs: the request has none"),
    (request(x={"datatype": "FP32", "shape": [1, 2], "contents": {"int_contents": [1, 2]}}),
     "input 'x': contents.int_contents does not hold FP32 (send contents.fp32_contents)"),
    (request(x={"datatype": "FP32", "shape": [1, 2], "contents": {"fp32_contents": [1.0]}}),
     "input 'x': shape [1, 2] needs 2 elements, contents.fp32_contents has 1"),
    (request(small={"datatype": "INT8", "shape": [1], "contents": {"int_contents": [300]}}),
     "input 'small': a value of contents.int_contents lies outside the range of INT8"),
    (request(x={"datatype": "FP16", "shape": [1]}), "input 'x': FP16 has no typed contents"),
    (request(x={"datatype": "FP99", "shape": [1]}), "input 'x': unknown datatype 'FP99'"),
    (request(x={"datatype": "FP32", "shape": [-2]}), "input 'x': shape [-2] has a negative dimension"),
])
def test_a_bad_request_names_its_field(message: pb.ModelInferRequest, says: str) -> None:
    with pytest.raises(InvalidInput) as err:
        decode_infer(message, CONTRACT)
    assert says in err.value.message


def test_raw_contents_are_one_per_input_and_never_beside_typed_ones() -> None:
    two = request(x={"datatype": "FP32", "shape": [1, 2]}, text={"datatype": "BYTES", "shape": [1]})
    two.raw_input_contents.append(np.zeros(2, np.float32).tobytes())
    with pytest.raises(InvalidInput, match="raw_input_contents: 1 entries for 2 inputs"):
        decode_infer(two, CONTRACT)
    both = request(x={"datatype": "FP32", "shape": [1, 2], "contents": {"fp32_contents": [1.0, 2.0]}})
    both.raw_input_contents.append(np.zeros(2, np.float32).tobytes())
    with pytest.raises(InvalidInput, match=r"input 'x': has both contents and raw_input_contents\[0\]"):
        decode_infer(both, CONTRACT)
    short = request(x={"datatype": "FP32", "shape": [1, 2]})
    short.raw_input_contents.append(b"\0" * 7)
    with pytest.raises(InvalidInput, match=r"input 'x': 7 bytes do not hold shape \[1, 2\] of FP32"):
        decode_infer(short, CONTRACT)
    with pytest.raises(InvalidInput, match="ModelInferRequest: not a valid protobuf message"):
        parse_message(b"\xff\xff\xff")


def test_requested_outputs_and_the_final_response_flag() -> None:
    message = request(x={"datatype": "FP32", "shape": [1, 2], "contents": {"fp32_contents": [1.0, 2.0]}})
    message.outputs.add(name="z")
    message.parameters["triton_enable_empty_final_response"].bool_param = True
    parsed = decode_infer(message, CONTRACT)
    assert parsed.outputs == ("z",) and parsed.final_response
    outputs = {"y": np.array([0.5], np.float32), "z": np.array([b"hi"], dtype=object)}
    reply = infer_response(CONTRACT, parsed, outputs, {"ember_rung": "hot"})
    assert [(o.name, o.datatype, list(o.shape)) for o in reply.outputs] == [("z", "BYTES", [1])]
    assert list(reply.raw_output_contents) == [b"\x02\x00\x00\x00hi"] and reply.id == "r-1"
    assert reply.parameters["ember_rung"].string_param == "hot"
    message.outputs.add(name="nope")
    with pytest.raises(InvalidInput, match=r"output 'nope': model 'm' has no such output \(has y, z\)"):
        decode_infer(message, CONTRACT)
    message.parameters["triton_enable_empty_final_response"].string_param = "yes"
    del message.outputs[-1]
    with pytest.raises(InvalidInput, match="parameters.triton_enable_empty_final_response: must be a bool_param"):
        decode_infer(message, CONTRACT)


TREE = [cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, EmberError)
        and cls is not EmberError]


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__name__)
def test_every_error_of_the_tree_has_a_grpc_code_of_its_own(cls: type[EmberError]) -> None:
    assert any(c in GRPC_CODE_OF for c in cls.__mro__)


@pytest.mark.parametrize(("err", "code"), [
    (errors.ContractInvalid("x"), "INVALID_ARGUMENT"), (errors.Unauthenticated("x"), "UNAUTHENTICATED"),
    (errors.Forbidden("x"), "PERMISSION_DENIED"), (errors.ModelNotFound("x"), "NOT_FOUND"),
    (errors.RateLimited("x"), "RESOURCE_EXHAUSTED"), (errors.Overloaded("x"), "UNAVAILABLE"),
    (errors.NotDelivered("x"), "UNAVAILABLE"), (errors.DeadlineExceeded("x"), "DEADLINE_EXCEEDED"),
    (errors.OutputMismatch("x"), "INTERNAL"), (errors.Cancelled("x"), "CANCELLED"),
])
def test_the_codes_of_the_tree(err: EmberError, code: str) -> None:
    assert grpc_code(err).name == code


def test_the_grpc_port_setting() -> None:
    assert load_serve_config().grpc_port is None   # the default: 8001 when it is free
    assert load_serve_config(grpc_port=0).grpc_port == 0
    with pytest.raises(InvalidInput, match="grpc_port: 9000 is the HTTP port too"):
        load_serve_config(port=9000, grpc_port=9000)
    with pytest.raises(InvalidInput, match="grpc_port: Input should be less than or equal to 65535"):
        load_serve_config(grpc_port=70000)
