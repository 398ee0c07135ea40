"""`--auth auto`: keys off on a loopback bind, on anywhere else; rate-limit settings."""

from __future__ import annotations

import pytest

from ember.config import is_loopback, load_serve_config
from ember.core.ratelimit import RateLimit
from ember.errors import InvalidInput


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
                                                ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                                ("::", False), ("10.0.0.5", False), ("example.com", False)])
def test_auto_means_keys_unless_the_bind_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    assert load_serve_config(host=host).auth_enabled is not loopback
    assert load_serve_config(host=host, auth="on").auth_enabled
    assert not load_serve_config(host=host, auth="off").auth_enabled


def test_rate_limit_defaults_to_none_and_burst_to_one_seconds_worth() -> None:
    assert load_serve_config().rate_limit() is None
    assert load_serve_config(rate_limit_rps=2.5).rate_limit() == RateLimit(2.5, 3)
    assert load_serve_config(rate_limit_rps=0.1, rate_limit_burst=4).rate_limit() == RateLimit(0.1, 4)


@pytest.mark.parametrize(("values", "key"), [({"auth": "maybe"}, "auth"), ({"rate_limit_rps": 0}, "rate_limit_rps"),
                                             ({"rate_limit_burst": 3}, "rate_limit_burst")])
def test_bad_settings_name_their_key(values: dict[str, object], key: str) -> None:
    with pytest.raises(InvalidInput, match=key):
        load_serve_config(**values)
