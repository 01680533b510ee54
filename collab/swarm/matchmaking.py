"""Forming the group of a round: which peers average together for ``(step, phase)``.

Protocol (one round):

1. every peer announces itself in the DHT under ``{run_id}_round_{step}.{phase}`` (subkey: its peer key,
   value: its device index) and, a moment later, reads who else announced;
2. the first of the announced, reachable ones in the **leader order** is the leader; the others send
   it a ``collab.join`` call and wait. The order: fewest alive peers banning it (every alive record
   names the peers its writer bans), then smallest key. Every peer reads the same records, so the order
   is the same for all even while their bans differ: an attacker that one honest peer has caught and
   another has not yet is not followed by either (seen under load: an honest peer kept following an
   attacker the others banned, and the run stopped for lack of progress). Records only order leaders:
   a peer bans only what it verified itself;
3. the leader closes the group when every live peer has joined, or when ``target_group_size`` is reached,
   or when ``min_matchmaking_time_s`` has passed and every announced peer has joined (one that has died
   since, its alive record gone, is not waited for), or at ``matchmaking_timeout_s``; it answers every
   joiner with the member list, ordered canonically by ``(device index, peer key)`` - the order in which
   every member sums contributions. A joiner says how long it waits (``wait_s``); the leader answers
   ``timeout`` before that rather than list a member that has given up.

**Steady state.** When the peers alive are exactly the members of the last group this peer committed with,
the round skips the DHT: the last group's first peer in the leader order leads without reading
announcements, and every other member calls it at once. The leader stores its own announcement only when
the group is slow to fill (``Timing.steady_announce_s``) or closes without an alive peer that trains (a
member of the last group, a peer it suspects): one of those may look for the round the usual way and must
find this leader (and learn the group closed without it), not lead a second group of the round. A steady
round that fills at once touches the DHT not at all. Anything unusual - the leader unreachable or
redirecting, a peer joined or left the alive view (a newcomer appears there within a heartbeat, before
its first round, and the members then announce again, so it finds them) - falls back to the protocol
above for that round.

**A round is committed once.** A peer neither starts nor a leader closes a group for a round that
``min_group_size`` other peers' alive records already show done (their step is past it; for ``k.init``,
at ``k``): a second group committing it would split the run's state into two lineages (seen with 16
peers starting slowly: a late peer with the smallest key led a second ``0.init``). The round fails with
"already committed" and the peer catches up by state download. A single record cannot stop rounds.

A follower that learns of a smaller leader is redirected; a joiner that arrives after the group closed
gets ``closed``: the group may commit the round without it, so it never redoes the round apart (with other
latecomers it would commit a second version of it); it waits for the group to move ahead and takes its
state (:class:`LeftBehind`). A leader whose group failed answers ``failed`` instead, and joiners retry.
A group below ``min_group_size`` fails. Peers whose calls fail are suspected for ``suspect_ttl_s`` and
skipped; banned peers (:mod:`collab.swarm.bans`) are skipped too, and refused when they ask to join.

**Bans are local**, so a joiner names the peers it has banned (``avoid``) and the leader never closes a
group holding both a peer and one it bans (their round would fail at the exchange, every time): the
accused peer stays out when a majority of the group bans it (or exactly half, where the group would
be too small without the accusers), otherwise the accuser does (answered
``conflict``; it fails the round, waits for the group's members to move ahead and takes their state), so
a peer that bans honest members only shuts itself out. The leader then suspects the peer it left out, so
the next rounds do not wait for it. A joiner redirected to a leader it bans (its view of bans differs
from the others') does the same at once, rather than ask again until the round's deadline; and a peer
that sees a peer it bans announced first in the leader order joins it once, naming the ban, so that the group
of those who follow it does not wait for this peer until the deadline.

**Clients** (volunteers behind NAT: they listen nowhere, see ``SwarmNode(client_mode=True)``) announce
themselves as such (value ``[device index, "client"]``) and never lead: a client joins the first peer that
listens, waiting for one to announce; the steady-state leader is the last group's first non-client. A
leader lists its client joiners in ``Group.clients`` (part of the group id): they own no part of the
exchange. A joiner listed otherwise than it is fails the round.

**A leader whose groups keep failing is passed over.** A peer that does not know of the others' ban
follows the banned leader, whose groups never gather enough members; the leader answers ``failed`` (with
``member``: the group failed with the joiner in it) or ``timeout``. The second such failure in a round (or
failures for longer than the matchmaking limit) makes the joiner skip that leader for ``suspect_ttl_s``
and follow the next in the leader order (seen in CI: an honest peer asked the banned leader of its round
for 60 s and stopped for lack of progress). A peer that then leads with nobody joining for half the
matchmaking limit goes back to the leader it passed over, once per round: the others may follow it for
good reasons (two honest leaders waiting for each other until the deadline would fail every round); so
does a joiner that another peer redirects to it, and a client that finds no other leader."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from hivemind.utils import get_dht_time

from collab.config import SwarmConfig
from collab.methods.base import RoundFailed
from collab.swarm.bans import Bans
from collab.swarm.records import AliveRecord, PeerStatus
from collab.swarm.timing import Timing
from collab.swarm.transport import WIRE_PROTOCOL, Header, Received, SwarmNode, TransportError

logger = logging.getLogger(__name__)


class JoinStatus(StrEnum):
    """A leader's answer to ``collab.join`` (travels as its string value)."""

    OK = "ok"
    REDIRECT = "redirect"  # another peer leads this round: ask it
    STATE_MISMATCH = "state_mismatch"  # the leader holds another state at this step
    CONFIG_MISMATCH = "config_mismatch"  # the leader runs another config
    BANNED = "banned"
    CLOSED = "closed"  # the group is formed without the joiner
    TIMEOUT = "timeout"  # the joiner's wait ran out before the group formed
    CONFLICT = "conflict"  # left out: the joiner bans, or a majority of the group bans, a member
    FAILED = "failed"  # the round failed at the leader


class Role(StrEnum):
    """This peer's part in one round's matchmaking."""

    PENDING = "pending"
    LEADER = "leader"
    FOLLOWER = "follower"


JOIN = "collab.join"
JOIN_ANSWER_MARGIN_S = 0.5  # a leader answers a joiner at least this long before the joiner gives up
MAX_AVOIDED = 64  # banned peers a joiner names to the leader
_MAY_TRAIN = frozenset({PeerStatus.STARTING, PeerStatus.SYNCING, PeerStatus.TRAINING})


def settle_bans(
    members: Iterable[str], avoids: dict[str, set[str]], *, keep: str, min_size: int = 1
) -> set[str]:
    """The members to leave out so that no member bans another (``avoids[p]``: whom ``p`` bans).

    First the accused that more than half of the members still in ban go, one at a time, the most
    accused first; so does one that exactly half ban where its accusers' leaving would take the group
    below ``min_size`` and its own would not (a CI failure, reproduced under load: a late joiner that
    never saw the attackers' parts led two honest peers that ban an attacker; the group of four split two
    against two, the honest pair went, and every round of the run failed). Only accused members leave in
    this pass, so attackers cannot shrink the group to turn a minority into a majority: an accuser's
    leaving never changes a count, and an accused one's takes its own accusations with it. Then, for each
    accusation left (the fewest accusers first), the accusers go. ``keep`` (the leader, who refused whom
    it bans already) always stays; a member only ``keep`` accuses goes. Deterministic in its inputs."""
    group = set(members)
    accused_by: dict[str, set[str]] = {}
    for accuser in group:
        for accused in avoids.get(accuser, set()):
            if accused in group and accused != accuser:
                accused_by.setdefault(accused, set()).add(accuser)
    out: set[str] = set()

    def leave(peer: str) -> None:
        group.discard(peer)
        out.add(peer)
        accused_by.pop(peer, None)
        for accusers in accused_by.values():
            accusers.discard(peer)

    while True:  # the accused a majority (or a needed half) bans
        size = len(group)
        for accused in sorted(accused_by, key=lambda p: (-len(accused_by[p]), p)):
            accusers = accused_by[accused]
            tie_needs_it = 2 * len(accusers) == size and size - len(accusers - {keep}) < min_size <= size - 1
            if accused != keep and accusers and (2 * len(accusers) > size or tie_needs_it):
                leave(accused)
                break
        else:
            break
    for accused in sorted(accused_by, key=lambda p: (len(accused_by[p]), p)):  # then the accusers
        accusers = accused_by.get(accused, set())
        if accused not in group or not accusers:
            continue
        leaving = accusers - {keep}
        for peer in sorted(leaving or ({accused} - {keep})):
            leave(peer)
    return out


def leader_order(view: dict[str, AliveRecord]) -> Callable[[str], tuple[int, str]]:
    """The sort key of the order in which peers lead: fewest alive peers whose records say they ban it,
    then smallest key. Every peer reads the same records, so they agree on it even while their own bans
    differ (a peer that has not caught an attacker yet does not follow it either)."""
    accusers: dict[str, int] = {}
    for reporter, rec in view.items():
        for banned in set(rec.bans) - {reporter}:
            accusers[banned] = accusers.get(banned, 0) + 1
    return lambda peer_key: (accusers.get(peer_key, 0), peer_key)


@dataclass(frozen=True)
class Group:
    """The members of one round, in canonical order, and an id every member computes the same way."""

    round_id: str
    members: tuple[tuple[int, str], ...]  # (device index, peer key), sorted
    nonce: str = ""  # chosen by the leader: a retried round with the same members is a new group
    clients: tuple[str, ...] = ()  # members that accept no incoming calls (sorted): they own no part

    @functools.cached_property
    def group_id(self) -> str:  # computed once: read many times per round
        text = self.round_id + "|" + self.nonce + "|" + ",".join(f"{d}:{p}" for d, p in self.members)
        if self.clients:
            text += "|clients:" + ",".join(self.clients)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    @property
    def peers(self) -> list[str]:
        return [p for _, p in self.members]

    @property
    def owners(self) -> list[str]:
        """The members that own a part of the exchange (all but the clients), in canonical order: part
        ``j`` belongs to ``owners[j]``."""
        clients = set(self.clients)
        return [p for _, p in self.members if p not in clients]

    def index_of(self, peer_key: str) -> int:
        return self.peers.index(peer_key)

    def __len__(self) -> int:
        return len(self.members)


@dataclass
class _Round:
    role: Role = Role.PENDING
    leader: str | None = None
    joiners: dict[str, int] = field(default_factory=dict)
    # joiners' state hashes, checked when the group closes (this peer's state is then at the round's step)
    hashes: dict[str, str | None] = field(default_factory=dict)
    mismatched: set[str] = field(default_factory=set)
    avoids: dict[str, set[str]] = field(default_factory=dict)  # joiner -> the peers it bans
    conflicts: set[str] = field(default_factory=set)  # joiners left out: they ban, or are banned by, members
    declined: dict[str, asyncio.Task[Group | None]] = field(default_factory=dict)  # banned leaders told
    # smaller announced peers skipped only because their groups kept failing with this peer in them
    passed_over: set[str] = field(default_factory=set)
    forgiven: set[str] = field(default_factory=set)  # failed leaders this peer went back to (once each)
    clients: set[str] = field(default_factory=set)  # joiners that accept no incoming calls
    announced_clients: set[str] = field(default_factory=set)  # announced as clients: never leaders
    announcing: asyncio.Task[None] | None = None  # a steady-state leader's announcement, stored meanwhile
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    group: asyncio.Future[Group] | None = None
    closed: bool = False
    created: float = field(default_factory=time.monotonic)


class LeftBehind(RoundFailed):
    """This peer is out of a round that others may commit without it: rather than redo the step apart
    (a second version of it would split the run's state), wait for one of ``peers`` to move ahead and
    take its state (``Catchup.follow``), for up to ``wait_s``."""

    def __init__(self, message: str, peers: Iterable[str], wait_s: float) -> None:
        super().__init__(message)
        self.peers, self.wait_s = list(peers), wait_s


class StateMismatch(RoundFailed):
    """This round's leader holds another state at the same step (two groups once committed the same step
    apart): adopt the leader's state (``peer``) and redo the step."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(message)
        self.peer = peer


class Matchmaker:
    """Runs on the node's event loop; ``form_group(round_id)`` returns the round's :class:`Group`."""

    def __init__(
        self,
        *,
        node: SwarmNode,
        run_id: str,
        cfg: SwarmConfig,
        device_index: int,
        config_version: str = "",
        bans: Bans | None = None,
        state_hash: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.node, self.run_id, self.cfg, self.device_index = node, run_id, cfg, device_index
        self.timing = Timing.of(cfg)
        self.bans = bans or Bans(duration_s=cfg.ban_duration_s, me=node.peer_key)
        self.config_version = config_version
        # what a joiner and its leader compare: the config and the wire protocol (peers of two protocols
        # in one group could not check each other's statements and would ban each other)
        self._join_version = f"{config_version}/wire{WIRE_PROTOCOL}"
        self._rounds: dict[str, _Round] = {}
        self._suspects: dict[str, float] = {}
        self._failed_leaders: dict[str, float] = {}  # leaders whose groups kept failing with us: until
        # (round, leader) -> when its group failed this peer (negative: came after it had failed)
        self._failures: dict[tuple[str, str], list[float]] = {}
        self._seen_alive: set[str] = set()
        # The hash of the committed state this peer enters rounds with: a leader refuses joiners whose
        # state differs, so two diverged states never average together.
        self.state_hash = state_hash
        self.rank: Callable[[str], tuple[int, str]] = leader_order({})
        self.alive_peers: dict[str, AliveRecord] = {}  # refreshed by the heartbeat
        self._last_group: frozenset[str] = frozenset()  # members of the last group committed with
        self._last_clients: frozenset[str] = frozenset()  # ... and the clients among them
        # A client (behind NAT) listens nowhere: it joins groups but never leads one
        self.client_mode = node.client_mode
        node.serve(JOIN, self._handle_join)

    # ---- bookkeeping --------------------------------------------------------------------------------
    def suspect(self, peer_key: str) -> None:
        """Avoid ``peer_key`` (as leader or member) for ``suspect_ttl_s``."""
        if peer_key != self.node.peer_key:
            self._suspects[peer_key] = time.monotonic() + self.cfg.suspect_ttl_s

    def is_suspect(self, peer_key: str) -> bool:
        """Suspected (a failed call, a leader whose groups kept failing) or banned (an invalid
        contribution): not a leader or member for us."""
        now = time.monotonic()
        return (
            self._suspects.get(peer_key, 0.0) > now
            or self._failed_leaders.get(peer_key, 0.0) > now
            or self.bans.is_banned(peer_key)
        )

    def _only_a_failed_leader(self, peer_key: str) -> bool:
        """Skipped only because its groups kept failing with this peer (not unreachable, not banned)."""
        now = time.monotonic()
        return (
            self._failed_leaders.get(peer_key, 0.0) > now
            and self._suspects.get(peer_key, 0.0) <= now
            and not self.bans.is_banned(peer_key)
        )

    def _leader_failed(self, leader: str, round_id: str, *, member: bool) -> None:
        """``leader``'s group of ``round_id`` failed for this peer (``member``: with this peer in it, or it
        timed out waiting; otherwise this peer came after it had failed). The second time with this peer
        in it, or failures for longer than the matchmaking limit, this peer stops following ``leader`` for
        ``suspect_ttl_s``: a leader that the others do not follow (they ban it, its views differ) fails
        every group it leads, and asking it again until the run's patience runs out helps nobody."""
        now = time.monotonic()
        horizon = now - self.timing.matchmaking_horizon_s
        for key in [k for k, v in self._failures.items() if max(abs(t) for t in v) < horizon]:
            self._failures.pop(key, None)
        seen = self._failures.setdefault((round_id, leader), [])
        seen.append(now if member else -now)
        in_group = sum(1 for t in seen if t > 0)
        if in_group >= 2 or now - min(abs(t) for t in seen) > self.timing.matchmaking_s:
            logger.info(
                "%s round %s: the groups of leader %s keep failing (%d times); looking past it",
                self.node.peer_key[-6:],
                round_id,
                leader[-6:],
                len(seen),
            )
            self._failed_leaders[leader] = now + self.cfg.suspect_ttl_s
            self._failures.pop((round_id, leader), None)

    def _forgive(self, r: _Round) -> list[str]:
        """Follow again, once this round, the leaders this peer passed over in it (it found no other
        group to join); returns them."""
        back = [p for p in r.passed_over if self._only_a_failed_leader(p)]
        for p in back:
            self._failed_leaders.pop(p, None)
            r.forgiven.add(p)
        r.passed_over.clear()
        return back

    def _round(self, round_id: str) -> _Round:
        r = self._rounds.get(round_id)
        if r is None:
            r = self._rounds[round_id] = _Round()
            r.group = asyncio.get_running_loop().create_future()
            horizon = time.monotonic() - self.timing.matchmaking_horizon_s
            old = []  # rounds are kept in the order they were made: only the oldest are looked at
            for k, v in self._rounds.items():
                if v.created >= horizon:
                    break
                old.append(k)
            for k in old:
                self._rounds.pop(k, None)
        return r

    @property
    def alive_peers(self) -> dict[str, AliveRecord]:
        return self._alive_peers

    @alive_peers.setter
    def alive_peers(self, view: dict[str, AliveRecord]) -> None:
        self._alive_peers = view
        self._seen_alive.update(view)
        self.rank = leader_order(view)

    def _gone(self, peer_key: str) -> bool:
        """Seen alive before, no longer alive: died (its announcements in the DHT outlive it)."""
        return peer_key in self._seen_alive and peer_key not in self._alive_peers

    def _key(self, round_id: str) -> str:
        return f"{self.run_id}_round_{round_id}"

    def _expected(self) -> set[str]:
        """Peers expected in rounds: alive trainers (not the coordinator), not suspected."""
        return {
            p
            for p, rec in self.alive_peers.items()
            if not self.is_suspect(p) and rec.status != PeerStatus.COORDINATOR
        }

    def _live_count(self) -> int:
        return len(self._expected()) or 1

    def _could_come(self, round_id: str) -> int:
        """Expected peers (not this one) that may still join ``round_id``: those whose alive record is not
        past the round's step (a record without a step counts)."""
        try:
            step = int(round_id.split(".", 1)[0])
        except ValueError:
            return len(self._expected())
        me = self.node.peer_key
        count = 0
        for p in self._expected():
            rec = self.alive_peers.get(p)
            if p != me and not (rec is not None and rec.step > step):
                count += 1
        return count

    def committed_elsewhere(self, round_id: str, members: Iterable[str] = ()) -> set[str]:
        """Expected peers, outside ``members`` and this one, whose alive record says they already hold the
        state ``round_id`` produces (``k.init`` makes step ``k``, any other phase of step ``k`` is done
        once the record is past ``k``): a group of them committed the round."""
        try:
            step_text, phase = round_id.split(".", 1)
            step = int(step_text)
        except ValueError:
            return set()
        done_at = step if phase == "init" else step + 1
        skip = {self.node.peer_key, *members}
        return {
            p
            for p in self._expected() - skip
            if (rec := self.alive_peers.get(p)) is not None and rec.step >= done_at
        }

    def _check_not_committed(self, round_id: str, members: Iterable[str] = ()) -> None:
        """Raise :class:`RoundFailed` when enough peers for a whole group (``min_group_size``; one lying
        record cannot stop rounds) already committed ``round_id``: a second group committing it would
        split the run's state in two lineages. The peers then catch up by state download instead."""
        done = self.committed_elsewhere(round_id, members)
        if len(done) >= max(1, self.cfg.min_group_size):
            raise RoundFailed(f"round {round_id}: {len(done)} peer(s) already committed it; catching up")

    def remember_group(self, members: Iterable[str], clients: Iterable[str] = ()) -> None:
        """The group of ``members`` (``clients`` among them) committed a round: the next may take the
        steady-state path (empty: a round failed, the next looks for its group the usual way)."""
        self._last_group = frozenset(members)
        self._last_clients = frozenset(clients) & self._last_group

    def _steady_leader(self) -> str | None:
        """The leader of the steady-state path, when it applies (see the module docstring)."""
        group = self._last_group
        if len(group) < max(2, self.cfg.min_group_size) or self.node.peer_key not in group:
            return None
        if self._expected() | {self.node.peer_key} != group:
            return None
        leaders = group - self._last_clients
        return min(leaders, key=self.rank) if leaders else None

    # ---- the joiner's side --------------------------------------------------------------------------
    async def form_group(self, round_id: str, *, deadline: float | None = None, steady: bool = True) -> Group:
        """The group of ``round_id``, formed by ``deadline`` (default: the matchmaking limit from now);
        ``steady=False`` skips the steady-state path (this peer just stepped down as its leader)."""
        me = self.node.peer_key
        start = time.monotonic()
        deadline = start + self.timing.matchmaking_s if deadline is None else deadline
        r = self._round(round_id)
        if r.closed:  # we are retrying this round: a new group, a new leader state
            self._rounds.pop(round_id, None)
            r = self._round(round_id)
        self._check_not_committed(round_id)
        steady_leader = self._steady_leader() if steady else None
        if steady_leader is not None:
            if steady_leader == me:
                r.role, r.leader = Role.LEADER, me
                return await self._lead(round_id, r, start, deadline, read_announced=False)
            r.role, r.leader = Role.FOLLOWER, steady_leader
            group = await self._ask(steady_leader, round_id, deadline)
            if group is not None:
                return group
            r.role, r.leader = Role.PENDING, None  # the usual path for this round
        await self._announce(round_id)
        await asyncio.sleep(
            min(0.02, self.cfg.min_matchmaking_time_s / 4)
        )  # let peers of this round announce
        while time.monotonic() < deadline:
            announced = await self._announced(round_id, deadline)
            candidates = [p for p in announced if p not in r.announced_clients]
            if self.client_mode and not candidates:  # a client never leads: wait for a peer that can
                if time.monotonic() - start >= self.timing.matchmaking_s / 2:
                    self._forgive(r)  # ... or go back to one it passed over: nobody else leads
                await asyncio.sleep(0.1)
                continue
            leader = min(candidates if self.client_mode else [me, *candidates], key=self.rank)
            if leader == me:
                r.role, r.leader = Role.LEADER, me
                return await self._lead(round_id, r, start, deadline)
            r.role, r.leader = Role.FOLLOWER, leader
            r.changed.set()  # waiting joiners see the new role and get redirected
            group = await self._ask(leader, round_id, deadline)
            if group is not None:
                return group
        raise RoundFailed(f"round {round_id}: no group within {self.cfg.matchmaking_timeout_s:.1f}s")

    def _may_look(self, r: _Round) -> bool:
        """Whether a peer outside this round's joiners may try the round: an alive peer that trains (a
        member of the last group missing, one this peer suspects; not one it bans, which it refuses
        anyway). A newcomer is in every member's view before its first round
        (:meth:`~collab.swarm.heartbeat.Heartbeat.wait_until_seen`), and its arrival ends the steady
        state."""
        inside = {self.node.peer_key, *r.joiners}
        return any(
            p not in inside and rec.status in _MAY_TRAIN and not self.bans.is_banned(p)  # banned: refused
            for p, rec in self.alive_peers.items()
        )

    def _announce_meanwhile(self, round_id: str, r: _Round) -> asyncio.Task[None]:
        """A steady-state leader's announcement of ``round_id``, stored in the background (once)."""
        if r.announcing is None:
            r.announcing = asyncio.create_task(self._announce(round_id))
            r.announcing.add_done_callback(lambda t: t.cancelled() or t.exception())
        return r.announcing

    async def _announce(self, round_id: str) -> None:
        """Store this peer's announcement of ``round_id`` (see the protocol above)."""
        expiration = get_dht_time() + self.timing.announce_ttl_s
        value: int | list[object] = [self.device_index, "client"] if self.client_mode else self.device_index
        await self.node.dht_store(self._key(round_id), self.node.peer_key, value, expiration)

    async def _ask(self, leader: str, round_id: str, deadline: float) -> Group | None:
        """Ask ``leader`` to take this peer into the round's group: the group, or ``None`` to look for
        the leader again (unreachable, redirected); raises :class:`RoundFailed` when the round is lost."""
        me = self.node.peer_key
        try:
            answer, _ = await self.node.call(
                leader,
                JOIN,
                {
                    "round": round_id,
                    "device_index": self.device_index,
                    "version": self._join_version,
                    "state_hash": self.state_hash(),
                    "wait_s": round(deadline - time.monotonic(), 3),
                    "avoid": self.bans.active_peers()[:MAX_AVOIDED],
                    "client": self.client_mode,
                },
                timeout_s=max(0.1, deadline - time.monotonic()),
            )
        except TransportError as e:
            logger.info("%s round %s: leader %s unreachable (%s)", me[-6:], round_id, leader[-6:], e)
            self.suspect(leader)
            return None
        status = answer.get("status")
        if status == JoinStatus.OK:
            members = tuple((int(d), str(p)) for d, p in answer["members"])
            raw_clients = answer.get("clients", [])
            clients = tuple(sorted({str(p) for p in raw_clients})) if isinstance(raw_clients, list) else ()
            peers = {p for _, p in members}
            if not set(clients) <= peers - {leader} or (me in clients) != self.client_mode:
                self.suspect(leader)
                raise RoundFailed(f"round {round_id}: leader {leader[-6:]} listed impossible clients")
            return Group(round_id, members, str(answer.get("nonce", "")), clients)
        if status == JoinStatus.REDIRECT:
            real = answer.get("leader")
            if isinstance(real, str) and self.bans.is_banned(real):
                # the others follow a peer this one bans: asking again until the deadline cannot help
                self._decline(round_id, real, deadline)
                raise LeftBehind(
                    f"round {round_id}: its leader {real[-6:]} is banned here",
                    [leader],
                    self.timing.left_out_s,
                )
            if isinstance(real, str) and self._only_a_failed_leader(real):
                # the others follow the leader this peer passed over: go back to it (once this round),
                # or be sent between the two until the deadline
                r = self._round(round_id)
                if real not in r.forgiven:
                    self._failed_leaders.pop(real, None)
                    r.forgiven.add(real)
            await asyncio.sleep(0.02)
            return None
        if status == JoinStatus.STATE_MISMATCH:
            raise StateMismatch(
                leader, f"round {round_id}: leader {leader[-6:]} holds another state at this step"
            )
        if status == JoinStatus.CLOSED:  # its group formed without this peer and may commit the round
            raise LeftBehind(
                f"round {round_id}: the group of leader {leader[-6:]} formed without this peer",
                [leader],
                self.timing.left_out_s,
            )
        if status == JoinStatus.CONFLICT:
            raise LeftBehind(
                f"round {round_id}: left out (it bans, or is banned by, members of the group)",
                [leader],
                self.timing.left_out_s,
            )
        if status == JoinStatus.CONFIG_MISMATCH:  # that leader runs another config: never follow it
            self.suspect(leader)
            raise RoundFailed(f"round {round_id}: leader {leader[-6:]} runs config {answer.get('version')}")
        if status in (JoinStatus.FAILED, JoinStatus.TIMEOUT):
            member = status == JoinStatus.TIMEOUT or answer.get("member") is True
            self._leader_failed(leader, round_id, member=member)
        raise RoundFailed(f"round {round_id}: leader {leader[-6:]} answered {status!r}")

    async def _announced(self, round_id: str, deadline: float) -> dict[str, int]:
        """The peers that announced ``round_id`` and may be its leader or members (not suspected, not
        banned). A banned one that the others would take for the leader is told this peer stays out."""
        me = self.node.peer_key
        found = await self.node.dht_get_dict(self._key(round_id))
        out = {}
        r = self._round(round_id)
        for peer, value in found.items():
            dev, client = value, False
            if isinstance(value, (list, tuple)) and len(value) == 2 and value[1] == "client":
                dev, client = value[0], True
            if peer == me or not isinstance(dev, int) or isinstance(dev, bool):
                continue
            if client:
                r.announced_clients.add(peer)
            if not self.is_suspect(peer):
                out[peer] = dev
            elif (
                (self.client_mode or self.rank(peer) < self.rank(me))
                and self._only_a_failed_leader(peer)
                and peer not in r.forgiven
            ):
                r.passed_over.add(peer)
        banned = [p for p in found if p != me and self.bans.is_banned(p) and p not in r.announced_clients]
        leaders = [p for p in out if p not in r.announced_clients] + ([] if self.client_mode else [me])
        if banned and (not leaders or min(map(self.rank, banned)) < min(map(self.rank, leaders))):
            self._decline(round_id, min(banned, key=self.rank), deadline)
        return out

    def _decline(self, round_id: str, leader: str, deadline: float) -> None:
        """Join ``leader``'s group once, naming the ban (``avoid``): peers that do not ban it follow it,
        and its group would otherwise wait for this peer's announcement until the deadline (their round
        then fails, every time, while the views of bans differ). It leaves this peer out (``conflict``)."""
        r = self._round(round_id)
        if leader in r.declined:
            return
        task = asyncio.create_task(self._ask(leader, round_id, deadline))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # the answer does not matter
        r.declined[leader] = task

    # ---- the leader's side --------------------------------------------------------------------------
    async def _lead(
        self, round_id: str, r: _Round, start: float, deadline: float, *, read_announced: bool = True
    ) -> Group:
        me = self.node.peer_key
        target = self.cfg.target_group_size
        # steady state: the members are known, read announcements only if the group is slow to fill
        last_read = 0.0 if read_announced else time.monotonic()
        announced: dict[str, int] = {}
        while True:
            now = time.monotonic()
            if not read_announced and now - start > self.timing.steady_announce_s:
                self._announce_meanwhile(round_id, r)  # slow to fill: a member may look the usual way
            if now - last_read > 0.1:
                announced, last_read = await self._announced(round_id, deadline), now
                if not read_announced and not set(announced) <= set(r.joiners):
                    # someone looks for this round the usual way: let it find its leader
                    with contextlib.suppress(Exception):  # a failed store: the round goes on
                        await asyncio.shield(self._announce_meanwhile(round_id, r))
                    read_announced = True
                smaller = [
                    p for p in announced if self.rank(p) < self.rank(me) and p not in r.announced_clients
                ]
                # Nobody follows this peer, and a smaller one it passed over (its groups kept failing)
                # still leads: the others may follow that one, so go back to it once rather than both
                # lead groups too small to hold until the deadline.
                if not smaller and not r.joiners and now - start >= self.timing.matchmaking_s / 2:
                    smaller = self._forgive(r)
                if smaller:  # a smaller peer showed up (or is followed again): it leads this round
                    r.role, r.leader = Role.FOLLOWER, min(smaller, key=self.rank)
                    r.changed.set()  # waiting joiners see the new role and get redirected
                    if time.monotonic() >= deadline:
                        raise RoundFailed(f"round {round_id}: no group in time")
                    return await self.form_group(round_id, deadline=deadline, steady=False)
            size = 1 + len(r.joiners)
            # A peer killed mid-round leaves its announcement behind: waiting for it would hold every
            # retry of the round until the deadline (and lose the joiners whose own deadlines come first).
            all_announced_joined = {p for p in announced if not self._gone(p)} <= set(r.joiners)
            everyone_here = all_announced_joined and size >= max(self._live_count(), self.cfg.min_group_size)
            # too few for a round yet: a member finishing its last microbatch may still come, so wait
            # (up to the deadline) rather than fail a round that a retry would then have to redo
            enough = size >= self.cfg.min_group_size
            waited = now - start >= self.cfg.min_matchmaking_time_s
            settled = waited and all_announced_joined and enough
            # this peer is behind: the others' alive records are past this round, and nobody will come
            behind = waited and not enough and self._could_come(round_id) + 1 < self.cfg.min_group_size
            if (
                (target is not None and size >= target)
                or everyone_here
                or settled
                or behind
                or now >= deadline
            ):
                break
            r.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(r.changed.wait(), timeout=0.05)
        r.closed = True
        if not read_announced and self._may_look(r):
            # closing without a peer that may try this round: it may look for it the usual way, and must
            # find this leader (and be told the group closed without it), not lead a second group of it
            # (stored meanwhile: one that looks first leads alone a while and reads again, every 0.1 s)
            self._announce_meanwhile(round_id, r)
        mine = self.state_hash()
        if mine is not None:  # two diverged states never average together
            r.mismatched = {p for p in r.joiners if r.hashes.get(p) not in (None, mine)}
        candidates = [me, *(p for p in r.joiners if p not in r.mismatched)]
        r.conflicts = settle_bans(candidates, r.avoids, keep=me, min_size=self.cfg.min_group_size)
        for p in r.conflicts:  # not waited for in the next rounds (it would come, and be left out again)
            self.suspect(p)
        members = sorted(
            [
                (self.device_index, me),
                *((d, p) for p, d in r.joiners.items() if p not in r.mismatched and p not in r.conflicts),
            ]
        )
        assert r.group is not None
        if len(members) < self.cfg.min_group_size:
            err = RoundFailed(
                f"round {round_id}: only {len(members)} peer(s), need {self.cfg.min_group_size}"
            )
            r.group.set_exception(err)
            r.group.exception()  # mark retrieved: joiners' handlers read it too
            raise err
        try:  # the view may have learned of it while this group formed (a slow start, a slow DHT)
            self._check_not_committed(round_id, (p for _, p in members))
        except RoundFailed as err:
            r.group.set_exception(err)
            r.group.exception()
            raise
        in_group = {p for _, p in members}
        group = Group(round_id, tuple(members), secrets.token_hex(8), tuple(sorted(r.clients & in_group)))
        r.group.set_result(group)
        return group

    async def _handle_join(self, header: Header, payload: Received, remote: str) -> tuple[Header, bytes]:
        round_id = str(header["round"])
        device_index = int(header["device_index"])
        if header.get("version") != self._join_version:
            return {"status": JoinStatus.CONFIG_MISMATCH.value, "version": self._join_version}, b""
        if self.bans.is_banned(remote):
            return {"status": JoinStatus.BANNED.value}, b""
        r = self._round(round_id)
        if self.client_mode:  # never a leader (the caller reached us over a connection we opened)
            if r.leader is not None and r.leader != self.node.peer_key:
                return {"status": JoinStatus.REDIRECT.value, "leader": r.leader}, b""
            return {"status": JoinStatus.FAILED.value}, b""
        theirs = header.get("state_hash")
        theirs = theirs if isinstance(theirs, str) else None
        # A joiner may come before this peer has finished the step before the round (its state is then
        # one step behind): compare states once this peer is in the round, at the latest when it closes.
        mine = self.state_hash() if r.role == Role.LEADER else None
        if mine is not None and theirs not in (None, mine):
            return {"status": JoinStatus.STATE_MISMATCH.value}, b""
        if r.closed:
            # failed (the joiner may retry; a member already heard it failed with it in it), or closed:
            # formed without the joiner (it must not redo the round apart) - a member asking again gets
            # the group once more
            formed = r.group is not None and r.group.done()
            if formed and r.group is not None and r.group.exception() is not None:
                return {"status": JoinStatus.FAILED.value}, b""
            if not (formed and remote in r.joiners):
                return {"status": JoinStatus.CLOSED.value}, b""
        if r.role == Role.FOLLOWER and r.leader is not None:
            return {"status": JoinStatus.REDIRECT.value, "leader": r.leader}, b""
        r.joiners[remote] = device_index
        r.hashes[remote] = theirs
        if header.get("client") is True:  # its own (authenticated) word: announcements can be forged
            r.clients.add(remote)
        else:
            r.clients.discard(remote)
        avoid = header.get("avoid")
        r.avoids[remote] = (
            {a for a in avoid[:MAX_AVOIDED] if isinstance(a, str)} if isinstance(avoid, list) else set()
        )
        r.changed.set()
        assert r.group is not None
        # Stop waiting a little before the joiner does: a group that closes after the joiner gave up
        # would list a member that never takes part, and the whole round would fail.
        budget = self.timing.announce_ttl_s
        wait_s = header.get("wait_s")
        if isinstance(wait_s, (int, float)) and math.isfinite(wait_s):
            budget = min(budget, wait_s - JOIN_ANSWER_MARGIN_S)
        give_up = time.monotonic() + budget
        while True:
            done, _ = await asyncio.wait({r.group}, timeout=0.05)
            if done:
                break
            if r.role == Role.FOLLOWER:  # this peer stepped down: send the joiner to the real leader
                r.joiners.pop(remote, None)
                return {"status": JoinStatus.REDIRECT.value, "leader": r.leader}, b""
            if time.monotonic() > give_up:
                r.joiners.pop(remote, None)
                return {"status": JoinStatus.TIMEOUT.value}, b""
        if remote in r.mismatched:  # whether or not the group held without it
            return {"status": JoinStatus.STATE_MISMATCH.value}, b""
        if r.group.exception() is not None:  # the group failed with the joiner in it
            return {"status": JoinStatus.FAILED.value, "member": True}, b""
        group = r.group.result()
        if remote in r.conflicts:
            return {"status": JoinStatus.CONFLICT.value}, b""
        if remote not in group.peers:
            return {"status": JoinStatus.CLOSED.value}, b""
        return {
            "status": JoinStatus.OK.value,
            "members": [[d, p] for d, p in group.members],
            "nonce": group.nonce,
            "clients": list(group.clients),
        }, b""
