"""An instance's request frames (ember/node/instance.py), served over a socket pair to a model in this process:
the caller's tenant, which the node puts in the frame, reaches a model that keeps state per tenant."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from ember.errors import InvalidInput
from ember.node.framing import Frame, recv_frame, send_frame
from ember.node.instance import InstanceServer, request_tenant
from ember.testing.service import fake_contracts

CHATTER = next(c for c in fake_contracts() if c.name == "chatter")   # `request` BYTES [1] in


class TenantEcho:
    """A streaming model keeping state per tenant (as the llm runtime's prefix cache does): it answers with the
    tenant it was told."""

    streams = True
    per_tenant = True

    def infer(self, inputs: Mapping[str, np.ndarray], stop: Any = None) -> dict[str, np.ndarray]:
        raise AssertionError("a streaming model is asked for its stream")

    def stream(self, inputs: Mapping[str, np.ndarray], stop: Any = None, *,
               tenant: str | None = None) -> Iterator[dict[str, np.ndarray]]:
        yield {"text": np.array([json.dumps(tenant).encode()], dtype=object)}


def request() -> dict[str, np.ndarray]:
    return {"request": np.array([b'{"prompt": "hi"}'], dtype=object)}


def served(headers: list[dict[str, Any]]) -> list[Frame]:
    """Each infer frame's first answer (a result or an error), in order."""
    ours, theirs = socket.socketpair()
    server = threading.Thread(target=InstanceServer(TenantEcho(), CHATTER).serve, args=(theirs,), daemon=True)
    server.start()
    answers = []
    try:
        for i, header in enumerate(headers):
            send_frame(ours, {"op": "infer", "id": i, **header}, request())
            frame = recv_frame(ours)
            while frame is not None and frame.op == "end":
                frame = recv_frame(ours)
            assert frame is not None
            answers.append(frame)
            if frame.op == "result":
                assert (end := recv_frame(ours)) is not None and end.op == "end"
    finally:
        ours.close()
        server.join(5)
    return answers


def test_each_request_reaches_the_model_with_the_tenant_its_frame_names() -> None:
    answers = served([{"tenant": "acme"}, {"tenant": "beta"}, {}])
    told = [json.loads(bytes(a.tensors()["text"][0])) for a in answers]
    assert told == ["acme", "beta", None]


@pytest.mark.parametrize("bad", [7, "", "a/b", "x" * 200, ["acme"]])
def test_a_frame_naming_no_tenant_name_is_refused_naming_the_field(bad: Any) -> None:
    (answer,) = served([{"tenant": bad}])
    assert answer.op == "error" and answer.header["kind"] == "InvalidInput"
    assert answer.header["message"].startswith("infer: 'tenant'")
    with pytest.raises(InvalidInput, match="infer: 'tenant'"):
        request_tenant({"tenant": bad})
    assert request_tenant({}) is None and request_tenant({"tenant": "acme"}) == "acme"
