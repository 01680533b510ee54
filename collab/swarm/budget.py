"""How long a member computes in a round: the round budget, or just enough for the target batch.

With ``swarm.target_batch_size`` a round stays open until the group has computed that many samples, as
hivemind.Optimizer's ``target_batch_size`` does, adapted to a replicated state: the group is formed first
(``Aggregator.prepare``), every member reads its fellow members' published rates (samples per second of
computation, in their alive records) and computes for ``target / sum(rates)`` seconds - at most
``round_time_s`` - so fast devices contribute more samples and nobody waits for the slowest. Without a
target, or before any rate is known, a member computes for ``round_time_s``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping

from collab.swarm.timing import Timing

RATE = "rate"  # the alive record's field: this peer's samples per second of computation (smoothed)


def published_rate(record: object) -> float | None:
    """The rate an alive record publishes, if it is a usable one."""
    if not isinstance(record, dict):
        return None
    rate = record.get(RATE)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        return None
    return float(rate) if math.isfinite(rate) and rate > 0 else None


def group_rate(members: list[str], alive: Mapping[str, object]) -> float | None:
    """The summed rate of ``members``; a member without a published rate counts at the others' median.
    ``None`` when no member has published one."""
    rates = {p: published_rate(alive.get(p)) for p in members}
    known = [r for r in rates.values() if r is not None]
    if not known:
        return None
    typical = statistics.median(known)
    return sum(typical if r is None else r for r in rates.values())


class RoundBudget:
    """A :class:`~collab.methods.base.MicrobatchPlan`: microbatches while the projected time of the next
    one stays within this round's budget (see the module docstring); the first always, unless the device
    cannot finish it before ``timing.tag_along_s`` (it then tags along with weight 0).

    ``members`` gives the current round's group (empty when none was formed); ``alive`` the alive view."""

    def __init__(
        self,
        *,
        round_time_s: float,
        target_batch_size: int | None,
        timing: Timing,
        members: Callable[[], list[str]],
        alive: Callable[[], Mapping[str, object]],
    ) -> None:
        self.round_time_s, self.target = round_time_s, target_batch_size
        self.deadline_s = timing.tag_along_s
        self._members, self._alive = members, alive

    def seconds(self) -> float:
        """This round's compute budget."""
        if self.target is None:
            return self.round_time_s
        rate = group_rate(self._members(), self._alive())
        if rate is None:
            return self.round_time_s
        return min(self.round_time_s, self.target / rate)

    def more(self, done: int, elapsed_s: float) -> bool:
        return done == 0 or elapsed_s * (done + 1) / done <= self.seconds()
