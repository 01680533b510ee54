"""Norm clipping of contributions, part by part: what a part owner does with a long part.

Honest contributions' norms are heavy-tailed: late in training one batch's gradient is dominated by its
worst sample, and a part ten or more times the group's median is honest data, not an attack. So an owner
does not drop a part whose norm is over ``ratio`` times the lower median of the counted parts' norms: it
scales it down to that norm (centered clipping's idea with the median as the centre of scale), and the
part counts with its full weight. A hostile peer gains nothing by a long part - clipped, it counts no
more than a part at the bound, which was let in unclipped before - and an honest one is no longer dropped
or banned for a norm up to ``ratio**2`` times the median. A part beyond that is treated as hostile
(:func:`~collab.compression.validate.outliers`; dropped and its sender banned) - an honest one that far
out still is, and the simulation, which drops nobody, then differs from the swarm.

The swarm clips each owner's part of the members' messages (part ``j`` of every message, cut as
:func:`~collab.compression.partition.split` cuts it), and ``collab simulate`` clips the same parts of the
devices' messages with :class:`PartClipping`: the same norms, factors and float32 products, so the swarm
still equals the simulation bit for bit - as long as the swarm cuts as the simulation does, every device
owning a part. Client-mode members own no part, so their groups cut into fewer parts: a round in which
something is clipped then differs from the simulation's (as a round that drops a member does).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from collab.compression.message import CompressedMessage
from collab.compression.partition import assemble, part_count, round_layout, split
from collab.compression.validate import norm_of


def clip_factors(norms: Mapping[int, float], ratio: float) -> dict[int, float]:
    """Member -> the factor (below 1) that brings its part's norm down to ``ratio`` times the lower median
    of ``norms`` (the counted parts'), for the parts over it. A zero median says nothing about scale:
    nothing is clipped then."""
    if not norms:
        return {}
    bound = ratio * statistics.median_low(norms.values())
    if not bound > 0:
        return {}
    return {i: bound / v for i, v in norms.items() if v > bound}


def clipped_norm(norms: Mapping[int, float], ratio: float) -> dict[int, float]:
    """Each member's part norm after :func:`clip_factors` (what an owner's account bounds)."""
    factors = clip_factors(norms, ratio)
    return {i: v * factors.get(i, 1.0) for i, v in norms.items()}


def scaled(msg: CompressedMessage, factor: float) -> CompressedMessage:
    """``msg`` with its values times ``factor`` (float32 products; a new tensor, the message is kept)."""
    return replace(msg, values=msg.values * factor)


@dataclass(frozen=True)
class PartClipping:
    """The swarm's clipping applied to whole messages in one process: cut every message as a round of
    ``len(messages)`` part owners cuts it (``single_owner_bytes``, ``shared_seed``: the run's settings
    that decide the cut), clip part ``j`` of the messages with weight among themselves, put them back."""

    ratio: float
    single_owner_bytes: int
    shared_seed: int

    def clip(
        self, messages: Sequence[CompressedMessage], weights: Sequence[float]
    ) -> list[CompressedMessage]:
        if not messages:
            return []
        first = messages[0]
        layout = round_layout(first, self.shared_seed)
        n = part_count(first, layout, len(messages), self.single_owner_bytes)
        parts = [split(m, n, layout) for m in messages]
        counted = [i for i, w in enumerate(weights) if w > 0]  # members tagging along are not compared
        factors = [clip_factors({i: norm_of(parts[i][j]) for i in counted}, self.ratio) for j in range(n)]
        out = list(messages)
        for i in counted:
            if any(i in f for f in factors):
                pieces = [scaled(p, f[i]) if i in f else p for p, f in zip(parts[i], factors, strict=True)]
                out[i] = assemble(pieces, layout=layout, numel=messages[i].numel, template=messages[i])
        return out
