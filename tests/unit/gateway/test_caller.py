"""What a forwarded request carries of its caller (ember/gateway/caller.py)."""

from __future__ import annotations

import asyncio

from ember.gateway.caller import Caller, forwarded_headers, set_caller

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_callers_key_tenant_and_trace_are_carried_the_current_span_over_the_callers_own() -> None:
    headers = {"authorization": "Bearer k", "traceparent": TRACE, "tracestate": "v=1", "other": "x"}
    assert Caller.of(headers, "acme", {}).headers() == {"authorization": "Bearer k", "x-ember-tenant": "acme",
                                                        "traceparent": TRACE, "tracestate": "v=1"}
    mine = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01"}
    assert Caller.of(headers, None, mine).headers() == {"authorization": "Bearer k", **mine}
    assert Caller.of({}, None, {}).headers() == {}


def test_each_request_task_has_its_own_caller_and_outside_one_there_is_none() -> None:
    async def request(key: str) -> dict[str, str]:
        set_caller(Caller(f"Bearer {key}"))
        await asyncio.sleep(0.01)
        return forwarded_headers()

    async def both() -> list[dict[str, str]]:
        return list(await asyncio.gather(request("a"), request("b")))

    assert asyncio.run(both()) == [{"authorization": "Bearer a"}, {"authorization": "Bearer b"}]
    assert forwarded_headers() == {}
