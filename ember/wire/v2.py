"""Wire models of the Open Inference Protocol (KServe V2) REST API, as ember speaks it.

Requests are validated with these once, at the gateway; `data` stays `Any` here because
its shape and element types are checked against the contract by the V2 codec, which names
the input in every error.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Wire(BaseModel):
    # V2 clients add fields of their own (e.g. Triton's `parameters` keys); be lenient there.
    model_config = ConfigDict(extra="ignore")


class InferInputTensor(_Wire):
    name: str = Field(min_length=1)
    shape: list[int]
    datatype: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: Any = None


class RequestedOutput(_Wire):
    name: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferRequest(_Wire):
    id: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[InferInputTensor] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None


class InferOutputTensor(_Wire):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferResponse(_Wire):
    model_name: str
    model_version: str
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[InferOutputTensor]


class ServerMetadata(_Wire):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(_Wire):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(_Wire):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class RepositoryIndexRequest(_Wire):
    ready: bool = False


class RepositoryModel(_Wire):
    name: str
    version: str
    state: str
    reason: str = ""


class RepositoryLoadRequest(_Wire):
    parameters: dict[str, Any] = Field(default_factory=dict)


class JobAcceptedBody(_Wire):
    """Body of a 202: the job to poll at `location`."""

    id: str
    status: str
    model_name: str
    model_version: str
    location: str
    retry_after: int


class JobBody(_Wire):
    """GET /v2/jobs/{id}: the job's state; the V2 infer response once it succeeded."""

    id: str
    status: str
    model_name: str
    model_version: str
    created_at: float
    finished_at: float | None = None
    response: InferResponse | None = None
    error: str | None = None


class ErrorBody(_Wire):
    error: str
