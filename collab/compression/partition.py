"""Split a message into ``n`` parts for a reduce-scatter and put the reduced parts back together.

Pure tensor code (no networking): the swarm uses it so that part ``j`` of every member's message goes
to member ``j``, who averages that part once with :func:`~collab.compression.aggregate.weighted_mean`
and returns the same bytes to everyone. Reassembling the reduced parts gives exactly what
``weighted_mean`` of the whole messages gives (same float64 operations per coordinate, same order).

Layouts:

* ``dense``  - the d values split into ``n`` contiguous position ranges;
* ``shared`` - Rand-k on shared coordinates: the k values split by position (every member has the same
  index list, so only values travel);
* ``sparse`` - explicit indices (Top-k, per-device Rand-k): the coordinate range ``[0, d)`` split into
  ``n`` ranges, each part carrying the entries whose index falls in its range.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from enum import StrEnum

import torch

from collab.compression.message import CompressedMessage, MessageKind


class Layout(StrEnum):
    """How a message is cut into parts (travels in part headers as its string value)."""

    DENSE = "dense"  # contiguous ranges of all coordinates
    SHARED = "shared"  # contiguous ranges of the values of Rand-k on coordinates every member shares
    SPARSE = "sparse"  # explicit (index, value) pairs, cut by coordinate range


LAYOUTS = tuple(Layout)


def layout_of(msg: CompressedMessage) -> Layout:
    if msg.kind == MessageKind.DENSE:
        return Layout.DENSE
    return Layout.SHARED if msg.kind == MessageKind.SHARED else Layout.SPARSE


def round_layout(msg: CompressedMessage, shared_seed: int) -> Layout:
    """How a round with this message is cut: Rand-k on the run's shared coordinates (``shared_seed``)
    travels as values only; anything else sparse (Top-k, per-device Rand-k) as explicit indices
    partitioned by coordinate range; dense messages by position."""
    if msg.kind == MessageKind.DENSE:
        return Layout.DENSE
    shared = msg.kind == MessageKind.SHARED and msg.seed == shared_seed
    return Layout.SHARED if shared else Layout.SPARSE


def part_count(msg: CompressedMessage, layout: Layout, owners: int, single_owner_bytes: int) -> int:
    """Into how many parts a round among ``owners`` part owners cuts ``msg``: one when the round is
    small (``4 x`` the model's coordinates - the shared Rand-k values for the ``shared`` layout - times
    the owners, at most ``single_owner_bytes``), else one per owner. It depends only on the owners, the
    layout and the model's size, never on a member's values, so every member computes the same."""
    entries = msg.count if layout == Layout.SHARED else msg.numel
    return 1 if owners > 1 and 4 * entries * owners <= single_owner_bytes else owners


def bounds(length: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ranges covering ``[0, length)``, sizes differing by at most one."""
    base, extra = divmod(length, n)
    out, start = [], 0
    for j in range(n):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out


def split(msg: CompressedMessage, n: int, layout: Layout | None = None) -> list[CompressedMessage]:
    """The ``n`` parts of ``msg`` (``layout`` defaults to the message's own; ``sparse`` also takes
    ``SHARED`` messages with per-device coordinates, sending their indices explicitly)."""
    layout = layout or layout_of(msg)
    if layout in (Layout.DENSE, Layout.SHARED):
        if layout == Layout.DENSE and msg.kind != MessageKind.DENSE:
            raise ValueError("dense layout needs a dense message")
        return [  # views of the message's values: a part is sent or averaged, never modified
            CompressedMessage(MessageKind.DENSE, hi - lo, msg.values[lo:hi])
            for lo, hi in bounds(msg.count, n)
        ]
    if layout != Layout.SPARSE or msg.indices is None:
        raise ValueError(f"cannot split a {msg.kind.name} message with layout {layout!r}")
    cuts = torch.tensor([hi for _, hi in bounds(msg.numel, n)][:-1], dtype=torch.int64)
    pos = torch.searchsorted(msg.indices, cuts).tolist()
    edges = [0, *pos, msg.count]
    return [
        CompressedMessage(MessageKind.SPARSE, msg.numel, msg.values[a:b].clone(), msg.indices[a:b].clone())
        for a, b in itertools.pairwise(edges)
    ]


def check_part(
    part: CompressedMessage, *, layout: Layout, numel: int, n: int, j: int, count: int | None
) -> None:
    """Raise ``ValueError`` unless ``part`` is a well-formed part ``j`` of ``n`` for the layout."""
    if layout in (Layout.DENSE, Layout.SHARED):
        total = numel if layout == Layout.DENSE else count
        if total is None:
            raise ValueError("shared layout needs the value count")
        lo, hi = bounds(total, n)[j]
        if part.kind != MessageKind.DENSE or part.numel != hi - lo:
            raise ValueError(f"part {j}/{n} must be {hi - lo} dense values")
        return
    lo, hi = bounds(numel, n)[j]
    if part.kind != MessageKind.SPARSE or part.numel != numel:
        raise ValueError(f"part {j}/{n} must be a sparse message over {numel} coordinates")
    assert part.indices is not None
    if part.count and (int(part.indices[0]) < lo or int(part.indices[-1]) >= hi):
        raise ValueError(f"part {j}/{n} has indices outside [{lo}, {hi})")


def assemble(
    parts: Sequence[CompressedMessage],
    *,
    layout: Layout,
    numel: int,
    template: CompressedMessage | None = None,
    values: torch.Tensor | None = None,
) -> CompressedMessage:
    """The whole reduced message from its reduced parts (in part order).

    ``template`` (the local message) supplies the shared index list and seed for the ``shared`` layout.
    ``values``: for the ``dense`` and ``shared`` layouts, the parts' values already joined (the caller
    placed them there), used as they are.
    """
    if values is None and layout in (Layout.DENSE, Layout.SHARED):
        values = torch.cat([p.values for p in parts])
    if layout == Layout.DENSE:
        assert values is not None
        return CompressedMessage(MessageKind.DENSE, numel, values)
    if layout == Layout.SHARED:
        if template is None or template.indices is None:
            raise ValueError("shared layout needs the local message as template")
        assert values is not None
        return CompressedMessage(
            MessageKind.SHARED, numel, values, template.indices, seed=template.seed, step=template.step
        )
    values = torch.cat([p.values for p in parts])
    indices = torch.cat([p.indices for p in parts if p.indices is not None])
    if indices.numel() == numel:
        return CompressedMessage(MessageKind.DENSE, numel, values)
    return CompressedMessage(MessageKind.SPARSE, numel, values, indices)
