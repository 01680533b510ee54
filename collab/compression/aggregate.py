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


def weighted_mean(messages: Sequence[CompressedMessage], weights: Sequence[float]) -> CompressedMessage:
    """``sum_i w_i * msg_i / sum_i w_i`` as a message, computed in a fixed order (see module docstring)."""
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
        acc = torch.zeros(messages[0].count, dtype=torch.float64)
        for m, w in zip(messages, weights, strict=True):
            acc.add_(m.values.double(), alpha=float(w))
        first = messages[0]
        return CompressedMessage(
            MessageKind.SHARED, numel, (acc / total).float(), first.indices, seed=first.seed, step=first.step
        )

    if all(m.kind == MessageKind.DENSE for m in messages):  # no index list to build (d int64s)
        acc = torch.zeros(numel, dtype=torch.float64)
        for m, w in zip(messages, weights, strict=True):
            acc.add_(m.values.double(), alpha=float(w))
        return CompressedMessage(MessageKind.DENSE, numel, (acc / total).float())

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
