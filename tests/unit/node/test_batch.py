"""Requests' tensors concatenated along the batch axis, and a batch's outputs split back per request."""

from __future__ import annotations

import numpy as np
import pytest

from ember.node.batch import concat, group_of, rows_of, split


def texts(*words: bytes) -> np.ndarray:
    arr = np.empty(len(words), dtype=object)
    arr[:] = list(words)
    return arr


def request(rows: int, start: int = 0) -> dict[str, np.ndarray]:
    return {
        "x": np.arange(start, start + rows * 3, dtype=np.float32).reshape(rows, 3),
        "ids": np.arange(start, start + rows, dtype=np.int64),
        "text": texts(*(f"row {start + i}".encode() for i in range(rows))),
    }


def test_concat_then_split_gives_every_request_its_own_rows_back() -> None:
    requests = [request(2, 0), request(1, 100), request(3, 200)]
    batch = concat(requests)
    assert batch["x"].shape == (6, 3) and batch["ids"].shape == (6,)
    assert batch["text"].dtype == object
    assert batch["text"].tolist() == [b"row 0", b"row 1", b"row 100", b"row 200", b"row 201", b"row 202"]
    parts = split(batch, [2, 1, 3])
    assert parts is not None and len(parts) == 3
    for part, original in zip(parts, requests, strict=True):
        assert list(part) == list(original)
        for name in original:
            assert part[name].dtype == original[name].dtype, name
            assert part[name].shape == original[name].shape, name
            assert part[name].tolist() == original[name].tolist(), name


def test_concat_of_one_request_is_that_request() -> None:
    only = request(2)
    batch = concat([only])
    assert batch.keys() == only.keys()
    assert all(batch[name] is only[name] for name in only)


def test_split_of_a_whole_batch_into_one_part() -> None:
    outputs = {"y": np.arange(4.0), "text": texts(b"a", b"b", b"c", b"d")}
    parts = split(outputs, [4])
    assert parts is not None and len(parts) == 1
    assert parts[0]["y"].tolist() == [0, 1, 2, 3] and parts[0]["text"].tolist() == [b"a", b"b", b"c", b"d"]


@pytest.mark.parametrize(
    "outputs",
    [
        {"y": np.zeros(5)},                                # one row short of 6
        {"y": np.zeros(7)},                                # one row too many
        {"y": np.zeros(6), "pooled": np.zeros((1, 4))},    # one output per batch, not per row
        {"y": np.zeros(6), "score": np.zeros(())},        # a scalar has no rows
    ],
)
def test_split_is_none_when_an_output_does_not_have_a_row_per_input_row(outputs: dict[str, np.ndarray]) -> None:
    assert split(outputs, [2, 1, 3]) is None


def test_rows_of() -> None:
    assert rows_of({"x": np.zeros((4, 3)), "ids": np.zeros(4, dtype=np.int64)}) == 4
    assert rows_of({"text": texts(b"a")}) == 1
    assert rows_of({"x": np.zeros((4, 3)), "ids": np.zeros(3)}) is None      # disagreeing first axes
    assert rows_of({"x": np.zeros((0, 3))}) is None                           # no rows at all
    assert rows_of({"x": np.zeros(())}) is None                               # a scalar: no batch axis
    assert rows_of({"x": np.zeros(()), "y": np.zeros(1)}) is None
    assert rows_of({}) is None


def test_group_of_ignores_the_row_count_and_input_order() -> None:
    a = {"x": np.zeros((1, 3), dtype=np.float32), "text": texts(b"a")}
    b = {"text": texts(b"b", b"c", b"d"), "x": np.ones((3, 3), dtype=np.float32)}
    assert group_of(a) == group_of(b)
    assert hash(group_of(a)) == hash(group_of(b))


@pytest.mark.parametrize(
    "other",
    [
        {"x": np.zeros((1, 4), dtype=np.float32), "text": texts(b"a")},      # another trailing size
        {"x": np.zeros((1, 3, 1), dtype=np.float32), "text": texts(b"a")},   # another rank
        {"x": np.zeros((1, 3), dtype=np.float64), "text": texts(b"a")},      # another datatype
        {"x": np.zeros((1, 3), dtype=np.float32)},                           # an input fewer
        {"y": np.zeros((1, 3), dtype=np.float32), "text": texts(b"a")},      # another name
    ],
)
def test_group_of_separates_requests_that_cannot_concatenate(other: dict[str, np.ndarray]) -> None:
    base = {"x": np.zeros((2, 3), dtype=np.float32), "text": texts(b"a", b"b")}
    assert group_of(base) != group_of(other)
