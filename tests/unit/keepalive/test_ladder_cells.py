"""The ladder's cell arithmetic: the faster neighbourhood search and cumulative sums give the floats of the
straightforward ones they replaced (the plans must not move)."""

from __future__ import annotations

import numpy as np
import pytest

from ember.keepalive.ladder_cells import NEAR_WIDTHS, _near, cumsum_cells, smoothed


def _near_reference(pmf: np.ndarray, alive: np.ndarray, events: np.ndarray | float) -> np.ndarray:
    """`_near` as first written: every width tried on every cell, from sums padded the widest width either side."""
    if np.any(events):
        cells, wide = len(pmf), NEAR_WIDTHS[-1]
        cp = np.zeros((cells + 1 + 2 * wide, *pmf.shape[1:]))
        ca = np.zeros_like(cp)
        np.cumsum(pmf, axis=0, out=cp[wide + 1: wide + 1 + cells])
        np.cumsum(alive, axis=0, out=ca[wide + 1: wide + 1 + cells])
        cp[wide + 1 + cells:] = cp[wide + cells]
        ca[wide + 1 + cells:] = ca[wide + cells]
        near = near_alive = np.empty(0)
        for w in NEAR_WIDTHS:
            hi, lo = slice(wide + w + 1, wide + w + 1 + cells), slice(wide - w, wide - w + cells)
            if w == NEAR_WIDTHS[0]:
                near, near_alive = cp[hi] - cp[lo], ca[hi] - ca[lo]
                continue
            short = near < events
            if not short.any():
                break
            np.copyto(near, cp[hi] - cp[lo], where=short)
            np.copyto(near_alive, ca[hi] - ca[lo], where=short)
    else:
        near, near_alive = pmf.copy(), alive.copy()
        near[1:] += pmf[:-1]
        near_alive[1:] += alive[:-1]
        near[:-1] += pmf[1:]
        near_alive[:-1] += alive[1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        near /= near_alive
    np.copyto(near, 1.0, where=near_alive <= 1e-12)
    return near


def _cells(rng: np.random.Generator, cells: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A pmf over cells per row (busy rows: most mass in the first cells; many cells empty) and its survival."""
    busy = rng.random(rows) < 0.5
    decay = np.where(busy, 0.3, 0.02)
    pmf = rng.exponential(1.0, (cells, rows)) * np.exp(-decay * np.arange(cells)[:, None])
    pmf *= rng.random((cells, rows)) < np.where(busy, 0.9, 0.2)
    pmf /= np.maximum(pmf.sum(axis=0) + rng.uniform(0.0, 2.0, rows), 1e-300)
    alive = np.maximum(1.0 - np.cumsum(pmf, axis=0) + pmf, 0.0)
    return pmf, alive


@pytest.mark.parametrize("cells", [1, 2, 3, 5, 10, 13, 33, 70, 248])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_near_gives_the_floats_of_trying_every_width_on_every_cell(cells: int, rows: int) -> None:
    rng = np.random.default_rng(cells * 1000 + rows)
    pmf, alive = _cells(rng, cells, rows)
    # Pseudo-arrivals none, few (most cells satisfied by their neighbours) or many (most search every width).
    for events in (0.0, 0.02, 5.0, rng.uniform(0.0, 0.5, rows), rng.uniform(0.5, 50.0, rows) / rows):
        np.testing.assert_array_equal(_near(pmf, alive.copy(), events), _near_reference(pmf, alive.copy(), events))


@pytest.mark.parametrize("cells", [4, 20, 90])
def test_near_where_a_neighbourhood_holds_exactly_the_pseudo_arrivals(cells: int) -> None:
    rng = np.random.default_rng(cells)
    pmf = rng.integers(0, 3, (cells, 500)) * (rng.random((cells, 500)) < 0.3) * 0.125   # sums exact: many ties
    alive = np.maximum(1.0 - np.cumsum(pmf, axis=0) + pmf, 0.0)
    for events in (0.125, 0.25, 0.5, np.full(500, 0.375)):
        np.testing.assert_array_equal(_near(pmf, alive.copy(), events), _near_reference(pmf, alive.copy(), events))


def test_near_of_one_row_of_cells() -> None:
    pmf, alive = _cells(np.random.default_rng(3), 40, 1)
    for events in (0.0, 0.05, 1.0):
        np.testing.assert_array_equal(_near(pmf[:, 0], alive[:, 0].copy(), events),
                                      _near_reference(pmf[:, 0], alive[:, 0].copy(), events))


@pytest.mark.parametrize("upto", [0, 1, 12, 13, 14, 40, 70])
def test_smoothed_up_to_a_cell_is_the_first_cells_of_the_whole(upto: int) -> None:
    # A plan asked up to a row's reach computes only its cells' hazards, from the sums over all cells gathered.
    rng = np.random.default_rng(upto)
    pmf, alive = _cells(rng, 70, 50)
    weight = rng.uniform(0.0, 2.0, 50)
    for events, heads in ((0.0, 13), (0.02, 13), (rng.uniform(0.0, 0.5, 50), 13), (0.3, 0)):
        whole = smoothed(pmf, alive.copy(), weight, events, heads=heads)
        np.testing.assert_array_equal(smoothed(pmf, alive.copy(), weight, events, heads=heads, upto=upto),
                                      whole[:upto])


@pytest.mark.parametrize("shape", [(1, 5), (9, 8192), (40, 10), (40, 300), (249, 256), (50,)])
def test_cumsum_cells_is_numpys_cumsum(shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(len(shape) + shape[0]).exponential(1.0, shape) * 10.0 ** np.arange(shape[0]).reshape(
        (-1,) + (1,) * (len(shape) - 1)) % 7.3
    np.testing.assert_array_equal(cumsum_cells(x), np.cumsum(x, axis=0))
    out = np.empty_like(x)
    assert cumsum_cells(x, out=out) is out
    np.testing.assert_array_equal(out, np.cumsum(x, axis=0))
    codes = (x > 1).astype(np.int16)
    np.testing.assert_array_equal(cumsum_cells(codes), np.cumsum(codes, axis=0))
