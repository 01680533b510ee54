"""Checks on a received contribution before it is averaged: what a hostile or broken peer may send.

Pure functions over messages and numbers (no networking). The structural checks - version, kind, lengths,
strictly increasing in-range indices - happen in :meth:`CompressedMessage.from_bytes` and
:func:`~collab.compression.partition.check_part`; here are the value checks (finite values, a norm and a
weight that are not outliers against the group) and the size bound of a well-formed part.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import torch

from collab.compression.message import CompressedMessage

HEADER_ALLOWANCE_BYTES = 1024
MAX_BYTES_PER_ENTRY = 4 + 5  # an f32 value and, for sparse parts, at most a 5-byte varint gap
NORM_BLOCK = 1 << 20  # values per float64 block of a norm


def max_part_bytes(entries: int) -> int:
    """The largest serialized part that can hold ``entries`` coordinates (anything bigger is hostile)."""
    return HEADER_ALLOWANCE_BYTES + MAX_BYTES_PER_ENTRY * max(0, entries)


def check_finite(msg: CompressedMessage) -> None:
    """Raise ``ValueError`` if any value is NaN or infinite."""
    if msg.count and not bool(torch.isfinite(msg.values).all()):
        bad = int((~torch.isfinite(msg.values)).sum())
        raise ValueError(f"{bad} non-finite value(s)")


def finite_norm(msg: CompressedMessage) -> float:
    """:func:`norm_of`, raising ``ValueError`` (as :func:`check_finite`) if any value is NaN or infinite:
    one pass instead of two (float32 squares summed in float64 cannot overflow, so the norm is finite
    exactly when every value is)."""
    norm = norm_of(msg)
    if not math.isfinite(norm):
        check_finite(msg)  # names the count
        raise ValueError("non-finite value(s)")
    return norm


def norm_of(msg: CompressedMessage) -> float:
    """L2 norm of the values, accumulated in float64 (float32 overflows for hostile inputs), block by
    block (no float64 copy of a large message: each block's stays in cache)."""
    values = msg.values
    squares = 0.0
    for lo in range(0, msg.count, NORM_BLOCK):
        squares += float(torch.linalg.vector_norm(values[lo : lo + NORM_BLOCK], dtype=torch.float64)) ** 2
    return math.sqrt(squares)


def outliers(values: Mapping[int, float], ratio: float, *, trusted: int | None = None) -> dict[int, str]:
    """Members whose value exceeds ``ratio`` times the group's lower median, with a reason.

    The lower median is an honest member's value whenever more than half of the members are honest,
    also in a group of two where the owner's own (``trusted``) value is the smaller one. A zero median
    says nothing about scale, so nothing is flagged then. ``trusted`` is never flagged.
    """
    finite = [v for v in values.values() if math.isfinite(v)]
    if not finite:
        return {}
    ref = statistics.median_low(finite)
    if not ref > 0:
        return {}
    return {
        i: f"{v:.3g} is over {ratio:g}x the group's median {ref:.3g}"
        for i, v in values.items()
        if i != trusted and not v <= ratio * ref
    }
