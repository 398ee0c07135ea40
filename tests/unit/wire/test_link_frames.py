"""The gateway link's frames (ember/wire/link_frames.py): what is encoded reads back the same, and any bytes read
as a request or a response are either one or an InvalidInput naming what is wrong."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.errors import InvalidInput
from ember.wire import link_frames as lf

_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
_TCHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_NAME = st.text(_TCHARS, min_size=1, max_size=20)
_VALUE = st.text(st.characters(codec="latin-1", exclude_categories=("Cc",)) | st.just("\t"), max_size=30)
_HEADERS = st.lists(st.tuples(_NAME, _VALUE), max_size=lf.MAX_HEADERS).map(tuple)


def read_request(raw: bytes, max_body: int = 1 << 20) -> lf.LinkRequest:
    meta_n, body_n = lf.request_sizes(raw[:lf.REQUEST_HEAD.size], max_body)
    rest = raw[lf.REQUEST_HEAD.size:]
    assert len(rest) == meta_n + body_n
    method, path, headers = lf.request_meta(rest[:meta_n])
    return lf.LinkRequest(method, path, headers, rest[meta_n:])


@settings(max_examples=200, deadline=None)
@given(method=st.sampled_from(lf.METHODS), path=_TEXT.map(lambda p: "/" + p), headers=_HEADERS,
       body=st.binary(max_size=200))
def test_a_request_reads_back_as_it_was_written(method: str, path: str, headers: lf.Headers, body: bytes) -> None:
    request = lf.LinkRequest(method, path, headers, body)
    assert read_request(request.encode()) == request


@settings(max_examples=200, deadline=None)
@given(status=st.integers(100, 599), headers=_HEADERS, body=st.binary(max_size=200))
def test_a_response_reads_back_as_it_was_written(status: int, headers: lf.Headers, body: bytes) -> None:
    raw = lf.LinkResponse(status, headers, body).encode()
    got_status, meta_n, body_n = lf.response_sizes(raw[:lf.RESPONSE_HEAD.size], 1 << 20)
    rest = raw[lf.RESPONSE_HEAD.size:]
    assert (got_status, lf.response_meta(rest[:meta_n]), rest[meta_n:meta_n + body_n]) == (status, headers, body)


def test_sizes_past_the_bounds_are_refused_naming_the_part() -> None:
    with pytest.raises(InvalidInput, match="request body of 101 bytes \\(at most 100\\)"):
        lf.request_sizes(lf.REQUEST_HEAD.pack(10, 101), max_body=100)
    with pytest.raises(InvalidInput, match="request meta"):
        lf.request_sizes(lf.REQUEST_HEAD.pack(lf.MAX_META + 1, 0), max_body=100)
    for status, meta, body in ((99, 0, 0), (600, 0, 0), (200, lf.MAX_META + 1, 0), (200, 0, 101)):
        with pytest.raises(InvalidInput, match="not a response head"):
            lf.response_sizes(lf.RESPONSE_HEAD.pack(status, meta, body), max_body=100)


@pytest.mark.parametrize(("meta", "named"), [
    (b"{", "not JSON"), (b"[1]", "not a JSON object"), (b'{"method": "PUT", "path": "/", "headers": []}', "method"),
    (b'{"method": "GET", "path": "x", "headers": []}', "path"),
    (b'{"method": "GET", "path": "/\xc3\xa9", "headers": []}', "path"),
    (b'{"method": "GET", "path": "/", "headers": {}}', "headers"),
    (b'{"method": "GET", "path": "/", "headers": [["a"]]}', "headers"),
    (b'{"method": "GET", "path": "/", "headers": [["a", "b\\r\\nX: y"]]}', "control characters"),
    (b'{"method": "GET", "path": "/", "headers": [["a b", "c"]]}', "token characters"),
    (b'{"method": "GET", "path": "/", "headers": [["", "c"]]}', "token characters"),
    (b'{"method": "GET", "path": "/", "headers": [["a", "\\u0100"]]}', "Latin-1"),
    (b"[" * 100_000, "not JSON"),
])
def test_a_malformed_request_meta_is_refused_naming_what_is_wrong(meta: bytes, named: str) -> None:
    with pytest.raises(InvalidInput, match=named):
        lf.request_meta(meta)


_JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                    max_size=3), max_leaves=10)


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(st.binary(max_size=60), st.dictionaries(
    st.sampled_from(["method", "path", "headers", "other"]), _JSONISH).map(lambda d: json.dumps(d).encode())))
def test_any_meta_is_a_request_or_invalid_input(data: bytes) -> None:
    try:
        method, path, headers = lf.request_meta(data)
    except InvalidInput as err:
        assert str(err).startswith("link: ")
        return
    assert method in lf.METHODS and path.startswith("/") and all(len(h) == 2 for h in headers)
