"""Durable jobs over HTTP: the 202 that hands one out, and `GET /v2/jobs/{id}` to poll it.

A 202 carries `Location: /v2/jobs/{id}` and `Retry-After` (whole seconds, at least 1).
Polling answers 200 with the job's status (queued, running, succeeded, failed); a succeeded
job holds the V2 infer response (JSON data, also for jobs submitted via /v1/embeddings),
a failed one its error. Unknown or expired jobs answer 404.
"""

from __future__ import annotations

import math

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.errors import EmberError
from ember.gateway.chat_shape import generates_text, one_row
from ember.gateway.context import gateway_of
from ember.gateway.errors import retry_after_header
from ember.gateway.service import Service
from ember.gateway.v2_codec import json_output
from ember.serving.results import JobAccepted
from ember.wire.contract import ModelContract
from ember.wire.v2 import InferOutputTensor, InferResponse, JobAcceptedBody, JobBody


def job_location(job_id: str) -> str:
    return f"/v2/jobs/{job_id}"


def accepted_response(contract: ModelContract, accepted: JobAccepted) -> JSONResponse:
    location = job_location(accepted.job_id)
    body = JobAcceptedBody(id=accepted.job_id, status="queued", model_name=contract.name,
                           model_version=contract.version, location=location,
                           retry_after=max(1, math.ceil(accepted.retry_after)))
    headers = {"Location": location, **retry_after_header(accepted.retry_after)}
    return JSONResponse(body.model_dump(), status_code=202, headers=headers)


async def get_job(request: Request) -> Response:
    # On a worker thread: the job store's lock may be held by a write that is fsyncing,
    # and waiting for it on the event loop would stall every other request.
    service = gateway_of(request).service
    job = await anyio.to_thread.run_sync(service.job, request.path_params["job_id"])
    response = None
    if job.state == "succeeded" and job.outputs is not None:
        tensors = one_row(job.outputs) if _generates_text(service, job.model, job.version) else job.outputs
        outputs = [InferOutputTensor.model_validate(json_output(n, a)) for n, a in tensors.items()]
        response = InferResponse(model_name=job.model, model_version=job.version, outputs=outputs)
    body = JobBody(id=job.job_id, status=job.state, model_name=job.model, model_version=job.version,
                   created_at=job.created_at, finished_at=job.finished_at, response=response, error=job.error)
    return JSONResponse(body.model_dump(exclude_none=True))


def _generates_text(service: Service, model: str, version: str) -> bool:
    """Whether the job's model is a text generation (its replies then answer as one row, as V2 infer's do)."""
    try:
        return generates_text(service.contract(model, version))
    except EmberError:   # no longer deployed: its tensors as they were kept
        return False
