"""Deterministic randomness derived from ``(seed, step, purpose)``.

Everything random that several peers must agree on (Rand-k coordinates, MASHA's shared coin, data order)
comes from here and from nothing else: no global RNG state, no dependence on which group a peer is in.

The generator is numpy's PCG64 seeded through ``SeedSequence``. Both the SeedSequence hash and PCG64's
raw 64-bit output stream (``random_raw``) are fixed by their published algorithms and identical on every
platform and numpy version; we only consume raw words and do our own (exactly uniform) range reduction,
so we never depend on the version-dependent distribution methods of ``numpy.random.Generator``.
"""

from __future__ import annotations

import zlib

import numpy as np

_MASK32 = np.uint64(0xFFFFFFFF)


def _purpose_code(purpose: str) -> int:
    return zlib.crc32(purpose.encode("utf-8"))


def bit_generator(seed: int, step: int, purpose: str, *extra: int) -> np.random.PCG64:
    """A PCG64 stream that depends only on ``seed``, ``step``, ``purpose`` and ``extra`` integers."""
    if seed < 0 or step < 0 or any(e < 0 for e in extra):
        raise ValueError("seed, step and extra words must be non-negative")
    entropy = [int(seed), int(step), _purpose_code(purpose), *(int(e) for e in extra)]
    return np.random.PCG64(np.random.SeedSequence(entropy))


def uniform_uint32(gen: np.random.PCG64, n: int) -> np.ndarray:
    """``n`` independent uniform 32-bit words (two per raw 64-bit draw)."""
    raw = gen.random_raw((n + 1) // 2).astype(np.uint64, copy=False)
    words = np.empty(2 * raw.size, dtype=np.uint32)
    words[0::2] = (raw & _MASK32).astype(np.uint32)
    words[1::2] = (raw >> np.uint64(32)).astype(np.uint32)
    return words[:n]


def uniform_below(gen: np.random.PCG64, n: int, bound: int) -> np.ndarray:
    """``n`` iid integers uniform on ``[0, bound)``, exactly (rejection sampling), as int64.

    Supports ``bound <= 2**32``. Rejection keeps the distribution exactly uniform; the expected
    overhead is below 2x in the worst case and negligible for the bounds we use.
    """
    if not 0 < bound <= 2**32:
        raise ValueError(f"bound must be in (0, 2**32], got {bound}")
    limit = (2**32 // bound) * bound  # accept words < limit
    out = np.empty(0, dtype=np.int64)
    need = n
    while need > 0:
        draw = max(16, int(need * 2**32 / limit) + 16)
        words = uniform_uint32(gen, draw).astype(np.int64)
        if limit < 2**32:
            words = words[words < limit]
        words = words[:need] % bound
        out = np.concatenate([out, words]) if out.size else words
        need = n - out.size
    return out


def uniform_float(seed: int, step: int, purpose: str) -> float:
    """One float uniform on ``[0, 1)`` with 53 bits of precision."""
    raw = int(bit_generator(seed, step, purpose).random_raw())
    return (raw >> 11) * (1.0 / 9007199254740992.0)


def coin(seed: int, step: int, purpose: str, p_one: float) -> bool:
    """A shared Bernoulli(``p_one``) coin."""
    return uniform_float(seed, step, purpose) < p_one


def torch_seed(seed: int, step: int, purpose: str, *extra: int) -> int:
    """A 63-bit seed for ``torch.Generator`` derived the same way (used for local minibatch order)."""
    return int(bit_generator(seed, step, purpose, *extra).random_raw()) >> 1


def derived_seed(seed: int, purpose: str) -> int:
    """A different 63-bit seed for an independent stream with the same run seed (e.g. the server's Rand-k)."""
    return int(bit_generator(seed, 0, "derive:" + purpose).random_raw()) >> 1
