"""The compressors: Identity, RandK (unbiased, shared seed) and TopK (contractive).

Each maps a dense float32 vector to a :class:`~collab.compression.message.CompressedMessage`.
They know tensors and seeds only; nothing of methods, peers or networks.

Constants (for a vector of ``d`` coordinates, ``k = k_of(d)``):

* RandK is unbiased with ``omega = d/k - 1``: it keeps ``k`` uniformly chosen coordinates scaled by ``d/k``.
* TopK is contractive with ``delta = k/d``: ``||C(x) - x||^2 <= (1 - k/d) ||x||^2``.
* Identity is both (``omega = 0``, ``delta = 1``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np
import torch

from collab.compression.message import CompressedMessage, MessageKind
from collab.compression.sampling import random_subset


def _as_flat_f32(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"compressors take float32 tensors, got {x.dtype}")
    return x.reshape(-1)


class Compressor(ABC):
    """Interface: ``compress(x, seed=, step=)`` returns a message; constants describe its quality."""

    name: str = "compressor"
    unbiased: bool = False

    @abstractmethod
    def k_of(self, numel: int) -> int:
        """Number of values a message of a ``numel``-vector carries."""

    @abstractmethod
    def compress(self, x: torch.Tensor, *, seed: int, step: int) -> CompressedMessage:
        """Compress the float32 tensor ``x`` (flattened). ``(seed, step)`` fix any randomness."""

    def omega(self, numel: int) -> float:
        """Variance constant of an unbiased compressor: E||Q(x)-x||^2 <= omega ||x||^2."""
        raise NotImplementedError(f"{self.name} is not an unbiased compressor")

    def delta(self, numel: int) -> float:
        """Contraction constant: ||C(x)-x||^2 <= (1 - delta) ||x||^2."""
        raise NotImplementedError(f"{self.name} is not a contractive compressor")

    def ratio_of(self, numel: int) -> float:
        return self.k_of(numel) / numel

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Identity(Compressor):
    """No compression: the dense vector."""

    name = "identity"
    unbiased = True

    def k_of(self, numel: int) -> int:
        return numel

    def compress(self, x: torch.Tensor, *, seed: int = 0, step: int = 0) -> CompressedMessage:
        flat = _as_flat_f32(x)
        return CompressedMessage(MessageKind.DENSE, flat.numel(), flat.detach().clone())

    def omega(self, numel: int) -> float:
        return 0.0

    def delta(self, numel: int) -> float:
        return 1.0


def _k_from_ratio(ratio: float, numel: int) -> int:
    return min(numel, max(1, round(ratio * numel)))


class RandK(Compressor):
    """Unbiased Rand-k with a shared seed.

    Keeps ``k = round(ratio * d)`` coordinates chosen uniformly without replacement by
    :func:`~collab.compression.sampling.random_subset` from ``(seed, step, d, k)`` and scales them by
    ``d/k``. Every device that uses the same ``(seed, step)`` picks the same coordinates, so indices are
    free (message kind ``SHARED``) and the average of the devices' messages is itself k-sparse.

    Example::

        msg = RandK(ratio=0.01).compress(x, seed=run_seed, step=k)
        x_hat = msg.decompress()          # E[x_hat] = x
    """

    name = "randk"
    unbiased = True

    def __init__(self, *, ratio: float, scale: bool = True) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        self.ratio = float(ratio)
        self.scale = scale

    def k_of(self, numel: int) -> int:
        return _k_from_ratio(self.ratio, numel)

    def compress(self, x: torch.Tensor, *, seed: int, step: int) -> CompressedMessage:
        flat = _as_flat_f32(x)
        d = flat.numel()
        k = self.k_of(d)
        idx = torch.from_numpy(random_subset(seed, step, d, k))
        values = flat[idx]
        if self.scale and k < d:
            values = values * (d / k)
        return CompressedMessage(MessageKind.SHARED, d, values, idx, seed=seed, step=step)

    def omega(self, numel: int) -> float:
        return numel / self.k_of(numel) - 1.0

    def __repr__(self) -> str:
        return f"RandK(ratio={self.ratio})"


# Below this many coordinates Top-k selects exactly on the whole vector; above it, it first finds a
# threshold from a sample so that only ~k candidates go through the exact selection.
_SAMPLED_THRESHOLD_MIN_NUMEL = 1 << 18
_THRESHOLD_SAMPLE = 1 << 16


def _select_with_ties(a: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted positions of the ``k`` largest entries of ``a``; equal values go to the lower position."""
    kth = torch.topk(a, k, largest=True, sorted=False).values.min()
    above = torch.nonzero(a > kth).squeeze(1)
    need = k - above.numel()
    ties = torch.nonzero(a == kth).squeeze(1)[:need]
    return torch.sort(torch.cat([above, ties])).values


class _Scratch:
    """Reusable work buffers: writing into memory already mapped is ~3x faster than into fresh pages."""

    def __init__(self) -> None:
        self.abs: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def get(self, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.abs is None or self.mask is None or self.abs.numel() != d:
            self.abs = torch.empty(d, dtype=torch.float32)
            self.mask = torch.empty(d, dtype=torch.bool)
        return self.abs, self.mask


def topk_indices(x: torch.Tensor, k: int, *, scratch: _Scratch | None = None) -> torch.Tensor:
    """Sorted int64 positions of the ``k`` largest ``|x_i|`` (ties: lower index first). ``x`` finite."""
    d = x.numel()
    if k >= d:
        return torch.arange(d, dtype=torch.int64)
    if scratch is not None and d >= _SAMPLED_THRESHOLD_MIN_NUMEL:
        a, mask = scratch.get(d)
        torch.abs(x, out=a)
    else:
        a, mask = x.abs(), None
    if d < _SAMPLED_THRESHOLD_MIN_NUMEL or k > d // 8:
        return _select_with_ties(a, k)
    # Find a threshold t with slightly more than k entries >= t, from a fixed-seed sample; then one pass
    # keeps the candidates, and the exact selection runs on ~k values instead of d.
    gen = torch.Generator().manual_seed(0x5EED)
    sample = a[torch.randint(d, (_THRESHOLD_SAMPLE,), generator=gen)]
    expected = _THRESHOLD_SAMPLE * k / d
    rank = min(_THRESHOLD_SAMPLE, math.ceil(expected + 4.0 * math.sqrt(expected) + 8))
    t = torch.topk(sample, rank, largest=True, sorted=False).values.min()
    # numpy's flatnonzero reads a bool mask in one pass; torch.nonzero takes ~3x longer on CPU.
    above = torch.ge(a, t, out=mask) if mask is not None else a >= t
    candidates = torch.from_numpy(np.flatnonzero(above.numpy()))
    if candidates.numel() < k:  # the sample was unlucky: fall back to the exact full selection
        return _select_with_ties(a, k)
    return candidates[_select_with_ties(a[candidates], k)]


class TopK(Compressor):
    """Contractive Top-k: keeps the ``k = round(ratio * d)`` entries of largest magnitude, unscaled.

    Deterministic: ties are broken by the lower index, so every device computes the same message for
    the same input. Indices are explicit (message kind ``SPARSE``) and cost ``index_bits(d)`` each.
    Large inputs are compressed with reusable work buffers (5 bytes per coordinate, kept by the instance).
    """

    name = "topk"
    unbiased = False

    def __init__(self, *, ratio: float) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        self.ratio = float(ratio)
        self._scratch = _Scratch()

    def k_of(self, numel: int) -> int:
        return _k_from_ratio(self.ratio, numel)

    def compress(self, x: torch.Tensor, *, seed: int = 0, step: int = 0) -> CompressedMessage:
        flat = _as_flat_f32(x)
        d = flat.numel()
        idx = topk_indices(flat, self.k_of(d), scratch=self._scratch)
        return CompressedMessage(MessageKind.SPARSE, d, flat[idx], idx)

    def delta(self, numel: int) -> float:
        return self.k_of(numel) / numel

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio})"


def make_compressor(name: str, ratio: float = 1.0) -> Compressor:
    """Build a compressor from its config name: ``identity``, ``randk`` or ``topk``."""
    if name == "identity":
        return Identity()
    if name == "randk":
        return RandK(ratio=ratio)
    if name == "topk":
        return TopK(ratio=ratio)
    raise ValueError(f"unknown compressor {name!r} (expected identity, randk or topk)")
