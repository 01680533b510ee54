"""How long a member computes in a round: the round budget, or just enough for the target batch.

With ``swarm.target_batch_size`` a round stays open until the group has computed that many samples, as
hivemind.Optimizer's ``target_batch_size`` does, adapted to a replicated state: the group is formed first
(``Aggregator.prepare``), every member reads its fellow members' published rates (samples per second of
computation, in their alive records) and computes for ``target / sum(rates)`` seconds - at most
``round_time_s`` - so fast devices contribute more samples and nobody waits for the slowest. Without a
target, or before any rate is known, a member computes for ``round_time_s``.

**Plausible claims.** A member's weight is the samples it says it computed, and nobody can check the
computation itself. What the others can check is that the claim fits what the member publishes about its
device - its rate and its microbatch (the samples of one evaluation), both capped at ``max_weight_ratio``
times the group's lower median so that inflating them buys little - and the round's compute budget: a
member evaluates its first microbatch, then more only while they fit in the budget, so it can claim at
most ``microbatch + CLAIM_SLACK * rate * budget`` (the slack covers a device that got faster since it last
published its rate). :class:`ClaimBounds` gives that bound per member; an owner counts a claim above it
at the bound, and drops and bans a member whose claim is ``max_weight_ratio`` times over it. An honest
fast device is never banned for being fast: its published rate says it is.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

from collab.config import SwarmConfig
from collab.swarm.records import AliveRecord
from collab.swarm.timing import Timing

CLAIM_SLACK = 8.0  # a device may be this much faster than the rate it last published


def published_rate(record: AliveRecord | None) -> float | None:
    """The rate an alive record publishes, if any."""
    return None if record is None else record.rate


def published_microbatch(record: AliveRecord | None) -> float | None:
    """The microbatch an alive record publishes, if any."""
    return None if record is None else record.microbatch


def capped(values: Mapping[str, float | None], ratio: float | None) -> dict[str, float | None]:
    """``values`` with each capped at ``ratio`` times their lower median (an honest member's value
    whenever more than half are honest), so one member's inflated number cannot dominate."""
    known = [v for v in values.values() if v is not None]
    if ratio is None or not known:
        return dict(values)
    cap = ratio * statistics.median_low(known)
    return {p: None if v is None else min(v, cap) for p, v in values.items()}


def group_rate(
    members: Sequence[str], alive: Mapping[str, AliveRecord], *, ratio: float | None = None
) -> float | None:
    """The summed rate of ``members`` (each capped at ``ratio`` times the lower median, if given); a
    member without a published rate counts at the others' median. ``None`` when no member has one."""
    rates = capped({p: published_rate(alive.get(p)) for p in members}, ratio)
    known = [r for r in rates.values() if r is not None]
    if not known:
        return None
    typical = statistics.median(known)
    return sum(typical if r is None else r for r in rates.values())


def round_seconds(
    members: Sequence[str],
    alive: Mapping[str, AliveRecord],
    *,
    round_time_s: float,
    target_batch_size: int | None,
    ratio: float | None = None,
) -> float:
    """The compute budget of a round of ``members``: ``round_time_s``, or less when the group's
    published rates gather ``target_batch_size`` samples sooner."""
    if target_batch_size is None:
        return round_time_s
    rate = group_rate(members, alive, ratio=ratio)
    return round_time_s if rate is None else min(round_time_s, target_batch_size / rate)


class ClaimBounds:
    """The most samples each member of a round can plausibly claim (see the module docstring).

    ``cfg`` is the run's swarm section (round budget, target batch, ``max_weight_ratio``), ``alive`` the
    alive view. Calling it with a group's members gives ``{member: bound}`` for the members whose alive
    record publishes what the bound needs (without a round budget: the microbatch alone; with one, also
    the rate); the others are left to the group-median check."""

    def __init__(self, cfg: SwarmConfig, alive: Callable[[], Mapping[str, AliveRecord]]) -> None:
        self.cfg, self._alive = cfg, alive

    def __call__(self, members: Sequence[str]) -> dict[str, float]:
        alive = self._alive()
        ratio = self.cfg.max_weight_ratio
        batches = capped({p: published_microbatch(alive.get(p)) for p in members}, ratio)
        if self.cfg.round_time_s is None:  # one microbatch per member and round
            return {p: b for p, b in batches.items() if b is not None}
        rates = capped({p: published_rate(alive.get(p)) for p in members}, ratio)
        budget = round_seconds(
            members,
            alive,
            round_time_s=self.cfg.round_time_s,
            target_batch_size=self.cfg.target_batch_size,
            ratio=ratio,
        )
        return {
            p: b + CLAIM_SLACK * r * budget
            for p in members
            if (b := batches[p]) is not None and (r := rates[p]) is not None
        }


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
        alive: Callable[[], Mapping[str, AliveRecord]],
        ratio: float | None = None,
    ) -> None:
        self.round_time_s, self.target, self.ratio = round_time_s, target_batch_size, ratio
        self.deadline_s = timing.tag_along_s
        self._members, self._alive = members, alive

    def seconds(self) -> float:
        """This round's compute budget."""
        return round_seconds(
            self._members(),
            self._alive(),
            round_time_s=self.round_time_s,
            target_batch_size=self.target,
            ratio=self.ratio,
        )

    def more(self, done: int, elapsed_s: float) -> bool:
        return done == 0 or elapsed_s * (done + 1) / done <= self.seconds()
