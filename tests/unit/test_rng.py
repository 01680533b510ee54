"""Shared randomness: reproducible, exactly uniform range reduction, fair coins."""

from __future__ import annotations

import numpy as np
import pytest

from collab.rng import bit_generator, coin, derived_seed, uniform_below


def test_streams_depend_only_on_arguments() -> None:
    a = uniform_below(bit_generator(1, 2, "x"), 100, 1000)
    b = uniform_below(bit_generator(1, 2, "x"), 100, 1000)
    c = uniform_below(bit_generator(1, 3, "x"), 100, 1000)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_pinned_stream() -> None:
    # PCG64 + SeedSequence are fixed algorithms and we do our own range reduction: these numbers must never
    # change, or peers with different installations would pick different Rand-k coordinates.
    got = uniform_below(bit_generator(7, 9, "pin"), 6, 10**6).tolist()
    assert got == PINNED


PINNED = [923569, 782648, 722391, 522176, 477210, 938441]


def test_uniform_below_range_and_fairness() -> None:
    draws = uniform_below(bit_generator(3, 0, "fair"), 60_000, 6)
    assert draws.min() == 0 and draws.max() == 5
    counts = np.bincount(draws, minlength=6)
    assert np.all(np.abs(counts - 10_000) < 500)
    with pytest.raises(ValueError):
        uniform_below(bit_generator(0, 0, "x"), 1, 0)


def test_coin_frequency() -> None:
    heads = sum(coin(11, k, "c", 0.3) for k in range(20_000))
    assert abs(heads / 20_000 - 0.3) < 0.015


def test_derived_seeds_differ() -> None:
    assert derived_seed(1, "a") != derived_seed(1, "b") != derived_seed(2, "a")
