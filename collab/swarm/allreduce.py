"""Exact reduce-scatter / all-gather: every group member ends with the same bytes for the average.

The group's owners (its members in canonical order, less its clients: peers that accept no incoming
calls) split the layout: owner ``j`` owns part ``j`` (see :mod:`collab.compression.partition`). Each
member, clients included, sends part ``j`` of its message, with its weight, to owner ``j`` in a
``collab.part`` call; the owner waits for all ``n`` parts, averages them **once** with
:func:`~collab.compression.weighted_mean` in canonical order, and answers every sender with the same
serialized result. Each member reassembles the ``n`` answers. Unlike hivemind's butterfly all-reduce (which
returns ``average - own_part`` for every sender to add back, so members differ in the last bits), nobody
adds anything afterwards: the aggregate is bit-identical on all members, and equal to the in-process
simulation's when the canonical order matches its device order.

**Validation.** The owner checks every part before averaging it: that it comes from the group member it
claims to be (the libp2p-authenticated sender), matches the round's layout as the owner computed it
itself, fits the size a well-formed part can have, parses (kind, lengths, strictly increasing in-range
indices), holds finite values, and that its norm is within ``max_norm_ratio**2`` times the group's lower
median. A part longer than ``max_norm_ratio`` times that median (honest norms are heavy-tailed) counts
scaled down to it (:mod:`collab.compression.clip`; the simulation clips alike). Its claimed
samples (weight) must be plausible for the sender's device: with
``claims`` (:class:`~collab.swarm.budget.ClaimBounds`) a claim above what the sender's published rate and
microbatch allow in this round's budget counts at that bound, and one ``max_weight_ratio`` times over it
fails; a sender without a published bound is held to ``max_weight_ratio`` times the group's lower median
(members of uneven speed honestly differ in samples per round). A part that fails is dropped
from this part's average, its sender is banned (:mod:`collab.swarm.bans`) and told why; the other
members get the average of the valid parts, and the list of dropped members, in the answer. Members
check the reduced parts they receive in a deterministic way (everyone receives the same bytes, so
everyone decides alike): well-formed, finite, and an RMS within ``max_norm_ratio**2`` of the other
parts' lower median; a bad one fails the round and bans its owner.

Per member and round: about ``(n-1)/n`` of its message is sent and ``(n-1)/n`` of the aggregate received,
plus the same again as owner - independent of the group size. A missing or late part fails the whole
round for everyone (no partial aggregate is ever applied).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from collab.compression import CompressedMessage, MessageFormatError, MessageKind, weighted_mean
from collab.compression.clip import clip_factors, clipped_norm, scaled
from collab.compression.message import DENSE_HEAD_BYTES
from collab.compression.partition import (
    Layout,
    assemble,
    bounds,
    check_part,
    layout_of,
    part_count,
    split,
)
from collab.compression.validate import finite_norm, max_part_bytes, norm_of, outliers
from collab.config import SwarmConfig
from collab.methods.base import RoundFailed
from collab.swarm.agreement import Agreement, Statement, part_digest
from collab.swarm.bans import Bans
from collab.swarm.matchmaking import Group
from collab.swarm.timing import PRUNE_EVERY_S, Timing
from collab.swarm.transport import (
    TAKEN,
    Header,
    Payloads,
    Received,
    RemoteError,
    Sink,
    SwarmNode,
    TransportError,
    gather_all,
    pieces_of,
)

logger = logging.getLogger(__name__)

PART = "collab.part"
MAX_OWNERS = 100_000  # a header's group size beyond this is nonsense
MEASURED_ROUND_BYTES = 1 << 20  # rounds of smaller messages are set by latency: not measured
UNKNOWN_GROUP_BYTES = 64 * 1024 * 1024  # parts buffered for groups this peer has not formed (yet)


async def _digest(
    group_id: str, j: int, wire: Payloads, dropped: Mapping[str, str], stats: Mapping[str, list[float]]
) -> str:
    """:func:`part_digest`, on a worker thread when the part is large (hashlib releases the GIL): the
    event loop keeps moving the round's other bytes meanwhile."""
    if sum(memoryview(piece).nbytes for piece in pieces_of(wire)) < MEASURED_ROUND_BYTES:
        return part_digest(group_id, j, wire, dropped, stats)
    return await asyncio.to_thread(part_digest, group_id, j, wire, dropped, stats)


def round_owners(
    group: Group, message: CompressedMessage, layout: Layout, single_owner_bytes: int
) -> list[str]:
    """The members that own a part of this round, in part order: all of ``group.owners``, or only the
    first of them when the round is small (:func:`~collab.compression.partition.part_count`)."""
    owners = group.owners
    return owners[: part_count(message, layout, len(owners), single_owner_bytes)]


def account_error(
    stats: Mapping[str, list[float]],
    norm: float,
    *,
    me: int,
    weight: float,
    counted: bool,
    own_norm: float,
    owner: int,
    excluded: set[int],
    bounds: Mapping[int, float],
    cfg: SwarmConfig,
) -> str | None:
    """Why an only owner's aggregate (L2 ``norm``) does not match its account ``stats`` (member index ->
    [weight, norm] of each contribution it counted), or ``None``.

    The account is in the owner's signed digest, so every member checks the same numbers, and each
    member vouches for its own entry (``me``): present exactly when the owner ``counted`` it, its norm as
    sent (``own_norm``), its weight what it claimed (less only when the claim was over the member's
    published bound, which the owner caps; ``bounds``: index -> the most samples a member's published
    device allows, as this member reads the records). Every entry is held to what an honest owner lets
    in - the owner's own, which nobody else checked, included: no dropped member, a norm within
    ``max_norm_ratio**2`` of the account's lower median, a weight within ``max_weight_ratio`` times its
    published bound (or, without one, of the lower median). Then the aggregate's norm must be within the
    weighted mean of the entries' norms as the owner clipped them (at ``max_norm_ratio`` times the lower
    median; a weighted mean is never longer): with every entry vouched for or bounded, the owner cannot
    inflate the aggregate past what it received."""
    entries = {int(k): v for k, v in stats.items()}
    if excluded & set(entries):
        return "the account names a member the owner dropped"
    entry = entries.get(me)
    if not counted and entry is not None:
        return "the account names this member, whose contribution was not counted"
    if counted:
        if entry is None:
            return "this member's contribution is missing from the account"
        w, n = entry
        capped = me in bounds and weight > 0.5 * bounds[me]  # near its bound: the owner may cap it
        if w > weight * (1 + 1e-9) or (w < weight * (1 - 1e-9) and not capped):
            return f"this member's weight in the account is {w:.6g}, it claimed {weight:.6g}"
        if abs(n - own_norm) > 1e-9 * own_norm + 1e-30:
            return f"this member's norm in the account is {n:.6g}, it sent {own_norm:.6g}"
    norms = {i: n for i, (_, n) in entries.items()}
    for i, why in outliers(norms, cfg.max_norm_ratio**2).items():
        who = "the owner's own" if i == owner else f"member {i}'s"
        return f"{who} contribution's norm {why}"
    weights = {i: w for i, (w, _) in entries.items()}
    unbounded = outliers(weights, cfg.max_weight_ratio)
    for i, w in weights.items():
        bound = bounds.get(i)
        over = w > cfg.max_weight_ratio * bound if bound is not None else i in unbounded
        if over:
            who = "the owner's own" if i == owner else f"member {i}'s"
            return f"{who} weight {w:.6g} is more than its device can have done"
    total = sum(weights.values())
    clipped = clipped_norm(norms, cfg.max_norm_ratio)  # as the owner clipped the long ones
    limit = sum(weights[i] * clipped[i] for i in entries) / total
    if not norm <= limit * (1 + 1e-6) + 1e-30:
        return f"norm {norm:.6g} over the {limit:.6g} its account allows"
    return None


def parse_stats(raw: object, members: int) -> dict[str, list[float]] | None:
    """An only owner's ``stats`` (member index -> [weight, norm] of each contribution it counted), or
    ``None`` when malformed (a well-formed one has canonical decimal indices of members - no aliases of
    one index - and finite numbers, weights positive, norms not negative)."""
    if not isinstance(raw, dict) or not 0 < len(raw) <= members:
        return None
    out: dict[str, list[float]] = {}
    try:
        for k, v in raw.items():
            if not (
                isinstance(k, str) and k.isascii() and k.isdigit() and k == str(int(k)) and int(k) < members
            ):
                return None
            if not isinstance(v, list) or len(v) != 2:
                return None
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                return None
            w, norm = float(v[0]), float(v[1])
            if not (math.isfinite(w) and math.isfinite(norm) and w > 0 and norm >= 0):
                return None
            out[k] = [w, norm]
    except (ValueError, OverflowError):  # e.g. an integer too large for a float
        return None
    return out


def message_size(message: CompressedMessage) -> int:
    """About the bytes ``message`` takes on the wire (what a round's waits are sized by)."""
    return message.bits // 8


class PeerUnreachable(RoundFailed):
    """The round failed because ``peer`` could not be reached (it is then avoided for a while)."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(message)
        self.peer = peer


@dataclass(frozen=True)
class _Params:
    """The round's layout as this owner computed it from its own message (never from a sender's word)."""

    n: int
    layout: Layout
    numel: int
    count: int | None
    shared_key: tuple[int, int] | None

    @classmethod
    def of(cls, header: Header) -> _Params:
        shared = header.get("shared_key")
        return cls(
            n=int(header["n"]),
            layout=Layout(str(header["layout"])),
            numel=int(header["numel"]),
            count=None if header.get("count") is None else int(header["count"]),
            shared_key=None if shared is None else (int(shared[0]), int(shared[1])),
        )

    def entries(self, j: int) -> int:
        total = self.count if self.layout == Layout.SHARED else self.numel
        lo, hi = bounds(total or 0, self.n)[j]
        return hi - lo


@dataclass(frozen=True)
class _Reduced:
    """One part's average as its owner answers it: the message, its wire bytes (pieces, not joined) and
    the members dropped from it (index -> reason)."""

    message: CompressedMessage
    wire: list[bytes | memoryview]
    excluded: dict[int, str]
    stats: dict[str, list[float]] = field(default_factory=dict)  # a round's only owner: index -> [w, norm]


@dataclass(frozen=True)
class _Placed:
    """A dense part's answer read in place: its header's bytes and its values, where they landed."""

    head: bytearray
    values: torch.Tensor


@dataclass
class _Slot:
    """Owner-side collection of one part of one group's round."""

    group: Group | None = None  # set when this member's own reduce() starts
    params: _Params | None = None
    me: int = -1  # the part this owner holds
    member: int = -1  # this owner's index among the group's members (the senders)
    received: dict[tuple[int, str], tuple[Header, Received]] = field(default_factory=dict)  # (sender, remote)
    refused: dict[tuple[int, str], str] = field(default_factory=dict)  # (sender, remote) -> reason
    conflicts: dict[tuple[int, str], str] = field(default_factory=dict)  # (sender, remote) -> reason
    own: tuple[CompressedMessage, float] | None = None
    total_weight: float = 0.0  # the samples behind this part's average (valid members only)
    result: asyncio.Future[_Reduced] | None = None
    out: torch.Tensor | None = None  # where this owner's member wants the average's values (dense layouts)
    averaging: bool = False  # every part is in: the average is being (or was) computed
    averager: asyncio.Future[None] | None = None  # the task computing it off the event loop (large parts)
    statement: asyncio.Future[Statement] | None = None  # this owner's signed word on the result (one for all)
    created: float = field(default_factory=time.monotonic)
    timing: Timing | None = None  # the waits for this round's payload (set by the first call that knows it)


class ExactReducer:
    """Serves ``collab.part`` and runs the member side of :meth:`reduce`.

    Args:
        node: this peer's node.
        cfg: the run's swarm section (timeouts, ``max_norm_ratio``).
        bans: where offenders go (default: a private list with ``cfg.ban_duration_s``).
        claims: the most samples each of a group's members can plausibly claim (see the module docstring;
            default: none known, every claim is held to the group-median check).
    """

    def __init__(
        self,
        *,
        node: SwarmNode,
        cfg: SwarmConfig,
        bans: Bans | None = None,
        claims: Callable[[Sequence[str]], Mapping[str, float]] | None = None,
    ) -> None:
        self.node, self.cfg, self._claims = node, cfg, claims
        self.timing = Timing.of(cfg)
        self.bans = bans or Bans(duration_s=cfg.ban_duration_s, me=node.peer_key)
        self.agreement = Agreement(node=node, timing=self.timing, bans=self.bans)
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._pruned_at = 0.0  # when old slots were last dropped
        self.last_excluded: dict[str, str] = {}  # peer -> reason, for the latest completed round
        self.last_share = 0.0  # this member's weight / the samples behind its own part, latest round
        self.link_b_s: float | None = None  # this peer's measured exchange rate (bytes/s), once known
        node.serve(PART, self._handle_part, on_refused=self._on_refused)

    def _slot(self, group_id: str, j: int) -> _Slot:
        key = (group_id, j)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot()
            slot.result = asyncio.get_running_loop().create_future()
            now = time.monotonic()
            if now - self._pruned_at >= PRUNE_EVERY_S:  # a scan of every slot per new slot cost ms per round
                self._pruned_at = now
                for old in [
                    k for k, s in self._slots.items() if s.created < now - self._times(s).slot_horizon_s
                ]:
                    self._slots.pop(old, None)
        return slot

    def _times(self, slot: _Slot, message_bytes: int | None = None) -> Timing:
        """The waits of ``slot``'s round, sized for ``message_bytes`` per member once known."""
        if slot.timing is None and message_bytes is not None:
            slot.timing = self.timing.for_payload(message_bytes, self.link_b_s)
        return slot.timing or self.timing

    def _measure(self, message_bytes: int, moved: int, elapsed_s: float) -> None:
        """Keep this peer's link rate (bytes moved per second of exchange, a running mean) from rounds
        large enough for bytes, not latency, to set their time."""
        if message_bytes < MEASURED_ROUND_BYTES or moved <= 0 or elapsed_s <= 0:
            return
        rate = moved / elapsed_s
        self.link_b_s = rate if self.link_b_s is None else (self.link_b_s + rate) / 2

    def _unknown_bytes(self) -> int:
        return sum(len(p) for s in self._slots.values() if s.group is None for _, p in s.received.values())

    @staticmethod
    def _is_member(group: Group, i: int, remote: str) -> bool:
        return 0 <= i < len(group) and group.peers[i] == remote

    def _on_refused(self, header: Header, reason: str, remote: str) -> None:
        """The transport refused a part before reading it (oversized): drop that sender from the round."""
        try:
            slot = self._slot(str(header["group_id"]), int(header["part"]))
            slot.refused[(int(header["sender"]), remote)] = reason
        except (KeyError, TypeError, ValueError, OverflowError):
            return
        self._maybe_finish(slot)

    async def _handle_part(self, header: Header, payload: Received, remote: str) -> tuple[Header, Payloads]:
        group_id, j, sender = str(header["group_id"]), int(header["part"]), int(header["sender"])
        slot = self._slot(group_id, j)
        if slot.group is not None and not self._is_member(slot.group, sender, remote):
            raise ValueError("sender is not that member of the group")
        old = slot.received.get((sender, remote))
        if old is None and slot.group is None and self._unknown_bytes() + len(payload) > UNKNOWN_GROUP_BYTES:
            raise ValueError("too many parts for groups this peer is not in")
        if old is None:
            slot.received[(sender, remote)] = (header, payload)
        elif (old[0].get("weight"), old[1]) != (header.get("weight"), payload):
            slot.conflicts[(sender, remote)] = "sent two different parts"
        self._maybe_finish(slot)
        n = header.get("n")
        size = len(payload) * n if isinstance(n, int) and 0 < n <= MAX_OWNERS else len(payload)
        result = await self._await_result(slot, size)
        if sender in result.excluded:
            raise ValueError(f"contribution rejected: {result.excluded[sender]}")
        answer: Header = {
            "ok": True,
            "excluded": {str(i): r for i, r in result.excluded.items()},
            "statement": (await asyncio.shield(self._statement(slot, j, result))).to_wire(),
            "samples": slot.total_weight,  # behind this part's average (a client's share reads it)
        }
        if result.stats:
            answer["stats"] = result.stats
        return answer, result.wire

    def _statement(self, slot: _Slot, j: int, result: _Reduced) -> asyncio.Future[Statement]:
        """This owner's signed statement on part ``j``'s result (signed once, sent to every member; the
        digest of a large part is computed off the event loop)."""
        if slot.statement is None:
            assert slot.group is not None
            gid = slot.group.group_id

            async def sign() -> Statement:
                dropped = {str(i): r for i, r in result.excluded.items()}
                return self.agreement.sign(gid, j, await _digest(gid, j, result.wire, dropped, result.stats))

            slot.statement = asyncio.ensure_future(sign())
        return slot.statement

    def _check(self, slot: _Slot, i: int) -> tuple[CompressedMessage, float, float]:
        """Member ``i``'s part, validated, its weight and its norm; raises ``ValueError`` with the reason
        it is rejected."""
        assert slot.group is not None and slot.params is not None
        peer = slot.group.peers[i]
        if self.bans.is_banned(peer):
            raise ValueError("banned")
        if (i, peer) in slot.conflicts:
            raise ValueError(slot.conflicts[(i, peer)])
        if (i, peer) in slot.refused:
            raise ValueError(slot.refused[(i, peer)])
        header, payload = slot.received[(i, peer)]
        try:
            if _Params.of(header) != slot.params:
                raise ValueError("part does not match the round's layout")
            weight = float(header["weight"])
        except (KeyError, TypeError, ValueError, IndexError, OverflowError):
            raise ValueError("part does not match the round's layout") from None
        if not (math.isfinite(weight) and weight >= 0):  # 0: a member tagging along (no samples)
            raise ValueError(f"invalid weight {weight!r}")
        limit = max_part_bytes(slot.params.entries(slot.me))
        if len(payload) > limit:
            raise ValueError(f"oversized part: {len(payload)} bytes, a valid one has at most {limit}")
        p = slot.params
        expected = (MessageKind.SPARSE,) if p.layout == Layout.SPARSE else (MessageKind.DENSE,)
        try:
            part = CompressedMessage.from_bytes(payload, max_numel=p.numel, kinds=expected, share=True)
        except MessageFormatError as e:
            raise ValueError(f"malformed part: {e}") from None
        check_part(part, layout=p.layout, numel=p.numel, n=p.n, j=slot.me, count=p.count)
        return part, weight, finite_norm(part)

    def _maybe_finish(self, slot: _Slot) -> None:
        """Average once every member's part is in (or refused): validate, drop and ban offenders. A large
        part is validated and averaged on a worker thread: the event loop goes on moving this member's
        own parts and answers meanwhile."""
        if slot.group is None or slot.params is None or slot.own is None or slot.result is None:
            return
        if slot.result.done() or slot.averaging:
            return
        n, me = len(slot.group), slot.member
        group = slot.group
        present = {i for i, remote in [*slot.received, *slot.refused] if self._is_member(group, i, remote)}
        if len(present | {me}) < n:
            return
        slot.averaging = True
        if 4 * slot.params.entries(slot.me) < MEASURED_ROUND_BYTES:
            self._settle(slot, self._average(slot))
            return

        async def off_loop() -> None:
            try:
                outcome = await asyncio.to_thread(self._average, slot)
            except Exception as e:  # a bug, not a peer's fault: the round fails, nobody is banned
                assert slot.result is not None
                if not slot.result.done():
                    slot.result.set_exception(RoundFailed(f"averaging failed: {type(e).__name__}: {e}"))
                    slot.result.exception()
                return
            self._settle(slot, outcome)

        slot.averager = asyncio.ensure_future(off_loop())  # held: a task nobody holds may be collected

    def _release(self, slot: _Slot) -> None:
        """The round is over for this member: let go of its parts, its message and its aggregate (the
        slot itself stays a while, so late calls learn the round is over; every member still in the
        round had its answers before this member could finish). Waits for an average in progress."""
        if slot.averager is not None and not slot.averager.done():
            slot.averager.add_done_callback(lambda _: self._release(slot))
            return
        slot.own, slot.out, slot.received = None, None, {}
        if slot.result is not None and slot.result.done():
            over = asyncio.get_running_loop().create_future()
            over.set_exception(RoundFailed("the round is over"))
            over.exception()  # retrieved: late callers read it
            slot.result = over

    def _settle(self, slot: _Slot, outcome: tuple[_Reduced | None, dict[int, str], float]) -> None:
        """Ban the members :meth:`_average` excluded and publish its result (unless the wait for the
        parts ran out meanwhile)."""
        assert slot.group is not None and slot.result is not None
        reduced, excluded, total = outcome
        for i, why in excluded.items():
            if why != "banned":
                self.bans.ban(slot.group.peers[i], why, slot.group.round_id)
        if slot.result.done():
            return
        if reduced is None:  # every member tagged along: nothing to average (the same verdict everywhere)
            slot.result.set_exception(RoundFailed("no member had samples in this round"))
            slot.result.exception()  # retrieved: awaited by the member and the senders
            return
        slot.total_weight = total
        slot.result.set_result(reduced)

    def _average(self, slot: _Slot) -> tuple[_Reduced | None, dict[int, str], float]:
        """The average of the valid parts (``None`` when no member had samples), the members excluded
        (index -> reason) and the samples behind the average. Bans nobody, sets nothing: thread-safe."""
        assert slot.group is not None and slot.own is not None and slot.params is not None
        n, me, group = len(slot.group), slot.member, slot.group
        valid: dict[int, tuple[CompressedMessage, float]] = {me: slot.own}
        norms = {me: norm_of(slot.own[0])}
        excluded: dict[int, str] = {}
        for i in range(n):
            if i == me:
                continue
            try:
                part, weight, norms[i] = self._check(slot, i)
                valid[i] = (part, weight)
            except ValueError as e:
                excluded[i] = str(e)
            except Exception as e:  # anything else a hostile part provokes is still its sender's fault
                excluded[i] = f"invalid part ({type(e).__name__})"
        # members tagging along (weight 0: too slow for this round) add nothing and are not compared
        counted = {i: (m, w) for i, (m, w) in valid.items() if w > 0}
        ratio = self.cfg.max_norm_ratio
        for i, why in outliers({i: norms[i] for i in counted}, ratio**2, trusted=me).items():
            excluded[i] = f"norm {why}"  # far beyond any honest spread: hostile
        self._check_claims(group, me, counted, excluded)
        for i in excluded:
            counted.pop(i, None)
        # a long part (honest norms are heavy-tailed) counts scaled down to the bound, as simulated
        for i, factor in clip_factors({i: norms[i] for i in counted}, ratio).items():
            logger.info(
                "round %s: clipping %s's part %d from norm %.3g by %.3g",
                group.round_id,
                group.peers[i][-6:],
                slot.me,
                norms[i],
                factor,
            )
            counted[i] = (scaled(counted[i][0], factor), counted[i][1])
        ordered = [counted[i] for i in sorted(counted)]
        if not ordered:
            return None, excluded, 0.0
        mean = weighted_mean([m for m, _ in ordered], [w for _, w in ordered], out=slot.out)
        # the only owner of a round publishes what it counted, so every member can bound the aggregate
        stats = {str(i): [counted[i][1], norms[i]] for i in sorted(counted)} if slot.params.n == 1 else {}
        return _Reduced(mean, mean.to_buffers(), excluded, stats), excluded, sum(w for _, w in ordered)

    async def _await_result(self, slot: _Slot, message_bytes: int) -> _Reduced:
        assert slot.result is not None
        try:
            wait_s = self._times(slot, message_bytes).allreduce_s
            return await asyncio.wait_for(asyncio.shield(slot.result), wait_s)
        except TimeoutError:
            if slot.result.done() and slot.result.exception() is None:  # completed as the wait ran out
                return slot.result.result()
            have = sorted({i for i, _ in slot.received})
            if not slot.result.done():
                slot.result.set_exception(
                    RoundFailed(f"parts missing: got {have} of {len(slot.group or ())}")
                )
                slot.result.exception()
            raise RoundFailed(f"parts missing: got {have}") from None

    def _check_claims(
        self,
        group: Group,
        me: int,
        counted: dict[int, tuple[CompressedMessage, float]],
        excluded: dict[int, str],
    ) -> None:
        """Hold every member's claimed samples to what it can plausibly have computed: over its bound it
        counts at the bound, ``max_weight_ratio`` times over it is excluded; members without a bound are
        held to ``max_weight_ratio`` times the group's lower median (honest speeds differ that much)."""
        ratio = self.cfg.max_weight_ratio
        bounds = self._claims(group.peers) if self._claims is not None else {}
        weights = {i: w for i, (_, w) in counted.items()}
        for i, why in outliers(weights, ratio, trusted=me).items():
            if group.peers[i] not in bounds:
                excluded.setdefault(i, f"weight {why}")
        for i, (msg, w) in counted.items():
            bound = bounds.get(group.peers[i])
            if bound is None or w <= bound:
                continue
            if w > ratio * bound and i != me:  # (an owner caps its own claim: the others check it)
                why = f"weight {w:.3g} is over {ratio:g}x the {bound:.3g} samples its device can have done"
                excluded.setdefault(i, why)
            else:  # a device faster than it published: it counts at what it can plausibly have done
                logger.info("counting %s's claim of %.3g samples at %.3g", group.peers[i][-6:], w, bound)
                counted[i] = (msg, bound)

    async def reduce(
        self, group: Group, message: CompressedMessage, weight: float, layout: Layout | str | None = None
    ) -> CompressedMessage:
        """This member's side of the round: returns the group's weighted average (identical everywhere).

        ``layout`` must be the same on every member (default: the message's own shape). The group's
        clients own no part: they send theirs to the owners and get the average back like everyone. Its
        waits grow with the message's size (:meth:`Timing.for_payload`), at the slower of the configured
        link and the rate this peer measured in earlier large rounds.
        """
        start, moved0 = time.monotonic(), self.node.bytes_sent + self.node.bytes_received
        try:
            mean = await self._reduce(group, message, weight, layout)
        finally:
            moved = self.node.bytes_sent + self.node.bytes_received - moved0
            self._measure(message_size(message), moved, time.monotonic() - start)
        # Committed: every member still in the round had its answers before this one could confirm. (A
        # failed round keeps its slots as they are until they expire: its owner part may still be
        # averaged and answered for the others.)
        for j in range(len(group.owners)):  # this group's slots (looked up, not a scan of every slot)
            slot = self._slots.get((group.group_id, j))
            if slot is not None and slot.group is not None:
                self._release(slot)
        return mean

    async def _reduce(
        self, group: Group, message: CompressedMessage, weight: float, layout: Layout | str | None
    ) -> CompressedMessage:
        me_key = self.node.peer_key
        size = message_size(message)
        times = self.timing.for_payload(size, self.link_b_s)
        if times is not self.timing:
            self.agreement.expect(group.group_id, times)
        if me_key not in group.peers:
            raise RoundFailed(f"round {group.round_id}: the leader's member list leaves this peer out")
        if not group.owners:
            raise RoundFailed(f"round {group.round_id}: no member can own a part")
        if self.node.client_mode and me_key in group.owners:
            raise RoundFailed(f"round {group.round_id}: this client is listed as a part owner")
        layout = Layout(layout) if layout is not None else layout_of(message)
        owners = round_owners(group, message, layout, self.cfg.single_owner_bytes)
        sender = group.index_of(me_key)
        mine = owners.index(me_key) if me_key in owners else None  # the part this member owns, if any
        n = len(owners)
        parts = split(message, n, layout)
        header: Header = {
            "group_id": group.group_id,
            "n": n,
            "layout": layout.value,
            "numel": message.numel,
            "count": message.count if layout == Layout.SHARED else None,
            "shared_key": [message.seed, message.step] if layout == Layout.SHARED else None,
            "sender": sender,
            "weight": weight,
            "round": group.round_id,
        }
        # dense parts' answers land in place in the aggregate's values (no per-part buffers to join), and
        # so does this owner's own average
        values = torch.empty(message.count, dtype=torch.float32) if layout != Layout.SPARSE else None
        spans = bounds(message.count, n)
        own: _Slot | None = None
        if mine is not None:
            own = self._slot(group.group_id, mine)
            own.group, own.me, own.member, own.params = group, mine, sender, _Params.of(header)
            own.own = (parts[mine], weight)
            own.out = None if values is None else values[spans[mine][0] : spans[mine][1]]
            for i, remote in list(own.received):  # parts that came before we knew the group
                if not self._is_member(group, i, remote):
                    own.received.pop((i, remote))
            self._maybe_finish(own)
        samples: dict[int, float] = {}  # part -> the samples behind it, as its owner says
        stats: dict[str, list[float]] | None = None  # the only owner's account of what it counted
        heads: dict[int, bytearray] = {}  # part -> the header of its answer, where the values went in place

        def sink_for(j: int) -> Sink | None:
            if values is None:
                return None
            lo, hi = spans[j]
            into = values[lo:hi].numpy().view(np.uint8).data

            def sink(answer: Header, size: int) -> list[memoryview] | None:
                if size != DENSE_HEAD_BYTES + into.nbytes:
                    return None  # not a well-formed answer: read as it is, judged below
                heads[j] = bytearray(DENSE_HEAD_BYTES)
                return [memoryview(heads[j]), into]

            return sink

        async def fetch(j: int) -> tuple[Received | _Placed | CompressedMessage, dict[str, str], Statement]:
            nonlocal stats
            if j == mine:  # the average this owner computed (the message its answers serialize)
                assert own is not None
                result = await self._await_result(own, size)
                dropped_here = {str(i): r for i, r in result.excluded.items()}
                return result.message, dropped_here, await asyncio.shield(self._statement(own, j, result))
            peer = owners[j]
            try:
                answer, reduced = await self.node.call(
                    peer,
                    PART,
                    {**header, "part": j},
                    parts[j].to_buffers(),
                    # the owner waits up to allreduce_timeout_s once our part is in: allow for the upload
                    timeout_s=times.part_call_s,
                    sink=sink_for(j),
                )
            except RemoteError as e:  # the owner answered: it is alive, the round failed elsewhere
                raise RoundFailed(f"part {j}: {e}") from None
            except TransportError as e:
                raise PeerUnreachable(peer, f"part {j} from {peer[-6:]}: {e}") from None
            raw = answer.get("excluded")
            dropped = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
            got = answer.get("samples")
            if isinstance(got, (int, float)) and not isinstance(got, bool) and math.isfinite(got):
                samples[j] = float(got)
            blob: Received | _Placed = reduced
            wire: Payloads = reduced
            if reduced is TAKEN:  # in place: the answer's header, then its values
                assert values is not None
                blob = _Placed(heads[j], values[spans[j][0] : spans[j][1]])
                wire = [blob.head, blob.values.numpy().view(np.uint8).data]
            got_stats: dict[str, list[float]] = {}
            if n == 1:
                parsed = parse_stats(answer.get("stats"), len(group))
                if parsed is None:
                    self.bans.ban(peer, "malformed account of its contributions", group.round_id)
                    raise RoundFailed(f"the answer of {peer[-6:]} accounts for its contributions wrongly")
                stats = got_stats = parsed
            digest = await _digest(group.group_id, j, wire, dropped, got_stats)
            return blob, dropped, self.agreement.check(group, j, digest, answer.get("statement"), owner=peer)

        answers = await gather_all([fetch(j) for j in range(n)])
        reduced_parts, rms, norms = [], {}, {}
        for j, (blob, _, _) in enumerate(answers):
            # Everyone receives these same bytes, so everyone takes the same decision on them.
            expected = (MessageKind.SPARSE,) if layout == Layout.SPARSE else (MessageKind.DENSE,)
            try:
                if isinstance(blob, CompressedMessage):
                    part = blob
                elif isinstance(blob, _Placed):
                    part = CompressedMessage.dense_from_pieces(blob.head, blob.values)
                else:
                    part = CompressedMessage.from_bytes(
                        blob, max_numel=message.numel, kinds=expected, share=True
                    )
                check_part(part, layout=layout, numel=message.numel, n=n, j=j, count=header["count"])
                norms[j] = finite_norm(part)
                rms[j] = norms[j] / math.sqrt(max(1, part.count))
            except Exception as e:  # whatever the bytes provoke: the same verdict on every member
                why = str(e) if isinstance(e, ValueError) else type(e).__name__
                self.bans.ban(owners[j], f"invalid reduced part: {why}", group.round_id)
                raise RoundFailed(f"part {j} from {owners[j][-6:]} is invalid: {why}") from None
            reduced_parts.append(part)
        # An owner could inflate its part of the aggregate: compare the parts' RMS (same bytes everywhere,
        # so the same verdict everywhere), with a wide margin since parts cover different coordinates.
        for j, why in outliers(rms, self.cfg.max_norm_ratio**2).items():
            self.bans.ban(owners[j], f"inflated reduced part: RMS {why}", group.round_id)
            raise RoundFailed(f"part {j} from {owners[j][-6:]} is inflated: RMS {why}")
        if n == 1 and mine is None:  # one part, nothing to compare it with: check the owner's account
            assert stats is not None
            dropped = {int(i) for i in answers[0][1] if i.isascii() and i.isdigit()}
            published = self._claims(group.peers) if self._claims is not None else {}
            wrong = account_error(
                stats,
                norms[0],
                me=sender,
                weight=weight,
                counted=weight > 0 and sender not in dropped,
                own_norm=norm_of(parts[0]),
                owner=group.index_of(owners[0]),
                excluded=dropped,
                bounds={i: published[p] for i, p in enumerate(group.peers) if p in published},
                cfg=self.cfg,
            )
            if wrong:
                self.bans.ban(owners[0], f"inflated aggregate: {wrong}", group.round_id)
                raise RoundFailed(f"the aggregate from {owners[0][-6:]} is inflated: {wrong}")
        excluded_now = {
            group.peers[int(i)]: str(r)
            for _, excluded, _ in answers
            for i, r in excluded.items()
            if str(i).isascii() and str(i).isdigit() and int(i) < len(group)
        }
        # every member still in the round assembled these same parts, or nobody commits
        statements = [s for _, _, s in answers]
        await self.agreement.confirm(
            group, statements, dropped=set(excluded_now), mine=me_key, timing=times, owners=owners
        )
        # a client owns no part: the samples behind part 0 (every part averages the same members)
        total = own.total_weight if own is not None else samples.get(0, 0.0)
        self.last_share = min(1.0, weight / total) if total > 0 else 0.0
        self.last_excluded = excluded_now
        if values is not None:  # the parts are in place but the ones not read there (this owner's, ...)
            for (lo, hi), part in zip(spans, reduced_parts, strict=True):
                if part.values.data_ptr() != values[lo:hi].data_ptr():
                    values[lo:hi] = part.values
        return assemble(reduced_parts, layout=layout, numel=message.numel, template=message, values=values)
