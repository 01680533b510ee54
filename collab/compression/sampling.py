"""Shared-seed uniform coordinate sets for Rand-k.

``random_subset(seed, step, numel, k)`` is the set of the first ``k`` distinct values in an iid stream
of integers uniform on ``[0, numel)``, drawn from ``collab.rng.bit_generator(seed, step, "randk", numel,
k)``. The first k distinct values of an iid uniform stream form a uniformly random k-subset, so this is
exact sampling without replacement. It never permutes all ``numel`` coordinates: draws are marked in a
byte mask and the sorted indices are read off the mask in one pass (O(numel) bytes, O(k) draws). When
``k > numel / 2`` the complement is sampled instead (also uniform).

The result depends only on its arguments: the same on every machine and in every process.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from collab.rng import bit_generator, uniform_below


def _mark_first_distinct(draws: np.ndarray, mask: np.ndarray, need: int) -> int:
    """Mark in ``mask`` the first ``need`` values of ``draws`` not yet marked (in draw order)."""
    uniq, first_pos = np.unique(draws, return_index=True)
    fresh = ~mask[uniq]
    order = np.sort(first_pos[fresh])[:need]
    mask[draws[order]] = True
    return int(order.size)


@lru_cache(maxsize=8)
def _cached_subset(seed: int, step: int, numel: int, k: int) -> np.ndarray:
    if k >= numel:
        return np.arange(numel, dtype=np.int64)
    complement = k > numel // 2
    m = numel - k if complement else k
    gen = bit_generator(seed, step, "randk", numel, k)
    mask = np.zeros(numel, dtype=bool)
    count = 0
    if m > 0:
        # Expected number of iid draws for m distinct values; the first batch aims a little below it,
        # so that it almost never overshoots and can be marked without ordering the draws.
        expected = -numel * math.log1p(-m / numel)
        first = int(expected * 0.97)
        if first > 0:
            draws = uniform_below(gen, first, numel)
            mask[draws] = True
            count = int(np.count_nonzero(mask))
            if count > m:  # rare overshoot: redo the batch in draw order
                mask[:] = False
                count = _mark_first_distinct(draws, mask, m)
        while count < m:
            need = m - count
            batch = int(need / (1.0 - count / numel) * 1.2) + 32
            count += _mark_first_distinct(uniform_below(gen, batch, numel), mask, need)
    return np.flatnonzero(~mask if complement else mask).astype(np.int64, copy=False)


def random_subset(seed: int, step: int, numel: int, k: int) -> np.ndarray:
    """Sorted int64 array of ``k`` distinct coordinates of ``[0, numel)``; cached: do not modify it."""
    if numel <= 0 or not 0 <= k <= numel:
        raise ValueError(f"need 0 <= k <= numel and numel > 0, got k={k}, numel={numel}")
    return _cached_subset(int(seed), int(step), int(numel), int(k))
