"""Exact, order-fixed weighted averaging of compressed messages.

``weighted_mean(messages, weights)`` is the one definition of "the aggregate" that every member of a
group computes: contributions are accumulated in float64 in the order given (callers pass a canonical
order, e.g. sorted peer id), divided by the total weight and rounded once to float32. Given the same
inputs in the same order, every process on every machine produces the same bits.

The result keeps the structure of the inputs: dense stays dense; Rand-k messages with the same shared
coordinates stay ``SHARED`` (k values, free indices); anything else becomes ``SPARSE`` on the sorted union
of the supports (at most ``M * k`` entries).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from collab.compression.message import CompressedMessage, MessageKind

MEAN_BLOCK = 1 << 18  # values per float64 block of an average (2 MiB: fits in cache)


def _same_shared_support(messages: Sequence[CompressedMessage]) -> bool:
    first = messages[0]
    return all(
        m.kind == MessageKind.SHARED and (m.seed, m.step, m.count) == (first.seed, first.step, first.count)
        for m in messages
    )


def union_support(messages: Sequence[CompressedMessage]) -> torch.Tensor:
    """Sorted union of the messages' index sets (all coordinates if any message is dense)."""
    numel = messages[0].numel
    if any(m.kind == MessageKind.DENSE for m in messages):
        return torch.arange(numel, dtype=torch.int64)
    idx = [m.indices for m in messages if m.indices is not None]
    return torch.unique(torch.cat(idx), sorted=True)


def _blocked_mean(
    values: Sequence[torch.Tensor], weights: Sequence[float], total: float, out: torch.Tensor | None
) -> torch.Tensor:
    """``sum_i w_i * values_i / total`` for equally long vectors, block by block: every element is computed
    exactly as over the whole vectors at once (float64 zeros, each ``add_`` in order, divided, rounded
    once), but the float64 temporaries stay in cache instead of taking 8 bytes per value."""
    if out is None:
        out = torch.empty(values[0].numel(), dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != values[0].shape:
        raise ValueError("out must be a float32 vector as long as the messages' values")
    acc = torch.empty(min(MEAN_BLOCK, out.numel()), dtype=torch.float64)
    for lo in range(0, out.numel(), MEAN_BLOCK):
        hi = min(lo + MEAN_BLOCK, out.numel())
        block = acc[: hi - lo].zero_()
        for v, w in zip(values, weights, strict=True):
            block.add_(v[lo:hi], alpha=float(w))  # promoted to float64 by the add, as .double() would
        out[lo:hi] = block.div_(total)
    return out


def weighted_mean(
    messages: Sequence[CompressedMessage], weights: Sequence[float], *, out: torch.Tensor | None = None
) -> CompressedMessage:
    """``sum_i w_i * msg_i / sum_i w_i`` as a message, computed in a fixed order (see module docstring).

    ``out``: where the values go when the result is dense or shared (as long as the messages' values;
    e.g. the caller's slice of a larger vector); ignored otherwise."""
    if not messages:
        raise ValueError("cannot average zero messages")
    if len(messages) != len(weights):
        raise ValueError("one weight per message")
    numel = messages[0].numel
    if any(m.numel != numel for m in messages):
        raise ValueError("messages of different lengths")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError("total weight must be positive")

    if _same_shared_support(messages):
        first = messages[0]
        values = _blocked_mean([m.values for m in messages], weights, total, out)
        return CompressedMessage(
            MessageKind.SHARED, numel, values, first.indices, seed=first.seed, step=first.step
        )

    if all(m.kind == MessageKind.DENSE for m in messages):  # no index list to build (d int64s)
        return CompressedMessage(
            MessageKind.DENSE, numel, _blocked_mean([m.values for m in messages], weights, total, out)
        )

    support = union_support(messages)
    acc = torch.zeros(support.numel(), dtype=torch.float64)
    for m, w in zip(messages, weights, strict=True):
        if m.kind == MessageKind.DENSE:
            acc.add_(m.values.double(), alpha=float(w))
        else:
            assert m.indices is not None
            pos = torch.searchsorted(support, m.indices)
            acc.index_add_(0, pos, m.values.double(), alpha=float(w))
    values = (acc / total).float()
    if support.numel() == numel:
        return CompressedMessage(MessageKind.DENSE, numel, values)
    return CompressedMessage(MessageKind.SPARSE, numel, values, support)
