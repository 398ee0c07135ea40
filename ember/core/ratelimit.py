"""Per-tenant rate limits: a token bucket (pure; time comes in as `now`).

Each tenant's bucket holds up to `burst` tokens and refills at `rate` tokens a second; a request takes
one. An empty bucket refuses, saying when the next token arrives (the `Retry-After` of a 429). Refused
requests take nothing, so a client that keeps retrying too early does not push its own turn further out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimit:
    rate: float   # tokens per second
    burst: int    # bucket size: requests that may come at once

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate: must be a positive number of requests per second, got {self.rate}")
        if self.burst < 1:
            raise ValueError(f"burst: must be at least 1, got {self.burst}")


@dataclass(frozen=True)
class Bucket:
    tokens: float
    at: float     # when `tokens` was counted


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    retry_after_s: float  # 0 when allowed
    bucket: Bucket        # the bucket after this request


def take(bucket: Bucket | None, now: float, limit: RateLimit) -> Verdict:
    """One request against the bucket (None: a tenant not seen yet, whose bucket is full)."""
    if bucket is None:
        tokens = float(limit.burst)
    else:
        # A clock that steps back refills nothing (and takes nothing away).
        tokens = min(float(limit.burst), bucket.tokens + max(0.0, now - bucket.at) * limit.rate)
    if tokens >= 1.0:
        return Verdict(True, 0.0, Bucket(tokens - 1.0, now))
    return Verdict(False, (1.0 - tokens) / limit.rate, Bucket(tokens, now))


class RateLimiter:
    """One bucket per tenant. Tenants come from the key file, so the map stays small."""

    def __init__(self, limit: RateLimit) -> None:
        self.limit = limit
        self._buckets: dict[str, Bucket] = {}

    def admit(self, tenant: str, now: float) -> Verdict:
        verdict = take(self._buckets.get(tenant), now, self.limit)
        self._buckets[tenant] = verdict.bucket
        return verdict
