"""The lone-surrogate walk: the path it names, and the memory it takes on a large body."""

from __future__ import annotations

import json
import tracemalloc

from ember.wire.json_text import lone_surrogate


def test_the_first_lone_surrogate_is_named_by_its_path() -> None:
    data = {"inputs": [{"name": "x", "data": [1, "ok", "\ud800"]}], "a b": {"\udfff": 1}}
    assert lone_surrogate(data) == "inputs[0].data[2]"
    assert lone_surrogate({"a b": {"\udfff": 1}}) == 'body["a b"] (a key)'
    assert lone_surrogate({"\udfff": 1}) == "body (a key)"
    assert lone_surrogate("\ud83d") == "body"
    assert lone_surrogate(["\ud83d"]) == "[0]"


def test_valid_text_and_pairs_are_not_named() -> None:
    assert lone_surrogate(json.loads('{"t": ["\\ud83d\\ude00", 1.5, null, true, {"k": []}]}')) is None
    assert lone_surrogate(7) is None


def test_the_walk_of_a_large_list_of_numbers_takes_little_memory() -> None:
    raw = json.dumps({"inputs": [{"name": "x", "data": [*range(500_000), "\ud800"]}]}).encode()
    data = json.loads(raw)
    tracemalloc.start()
    try:
        path = lone_surrogate(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert path == "inputs[0].data[500000]"
    assert peak < len(raw) // 10       # a path string per element took 17 times the body
