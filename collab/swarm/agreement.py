"""Agreement before commit: every member of a round checks that all assembled the same aggregate.

The exact reducer makes the aggregate bit-identical on honest members only if every part owner sends the
same bytes to everyone. An owner that sends different bytes for its part to different members would split
the swarm's state. So, before a member applies a round's aggregate (every signature is made with the
peer's libp2p identity key, Ed25519, :attr:`SwarmNode.identity`, and checked under the key its peer id
names, :func:`~collab.swarm.transport.peer_public_key`: what a statement or list says, its signer said,
however it travelled - nobody can sign in another's name):

1. **Signed parts.** The owner of part ``j`` signs a statement ``(group id, j, digest of the part's bytes
   and of its list of dropped members)`` and sends it with the part; a member checks the signature when
   the part arrives.
2. **Confirmation.** Each member - owner, client or any other - signs its list of the owners'
   statements it holds and sends it to the round's *collector*, the first member
   still in the round that is not a client, nor the only owner of a small round (members some owner
   dropped are not in the round: their lists are not waited for, but they get the answer and commit with
   the others); the collector answers every member with all the signed lists once it holds
   them all, or with a failure when one is missing by ``allreduce_timeout_s``. It
   decides once: every member that gets an answer gets the same one. A member commits only when every
   list is signed under its member's key and lists exactly its own digests.

Any difference fails the round for every member that sees it - all of them, since all see all lists. The
statements name who split: a member that holds two valid signatures of owner ``j`` over different
digests of part ``j`` bans ``j`` (it signed two different parts); a member whose signed list claims a
digest without a valid statement of that owner is banned (its own signature proves the lie, relayed or
not). A collector cannot forge another member's list (it would need that member's key), so the only owner
of a small round and the collector together cannot show two members two aggregates either; a list that
does not verify fails the round; only the collector, which got it straight from that member, bans the
member (to anyone else the collector may have tampered with it). A
collector that dies (or does not answer in time) fails the round for whoever waits on it, but it may have
answered others, who then commit: a member left :class:`Unconfirmed` first waits to see whether any
fellow member moves ahead, and then takes its state instead of redoing the step in another group (which
would split the swarm's lineage). A collector that misses a list does the same: members that an owner
told other dropped lists see another collector, and may commit without it.

Cost per round: ``n - 1`` calls in all (each member but the collector makes one; all-to-all would make
``n (n - 1)``); per member one signature for its part, one for its list, and ``2 n`` verifications.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from collab.methods.base import RoundFailed
from collab.swarm.bans import Bans
from collab.swarm.matchmaking import Group, LeftBehind
from collab.swarm.timing import PRUNE_EVERY_S, Timing
from collab.swarm.transport import (
    Header,
    Payloads,
    Received,
    RemoteError,
    SwarmNode,
    TransportError,
    peer_public_key,
    pieces_of,
)

logger = logging.getLogger(__name__)

CONFIRM = "collab.confirm"
_DOMAIN = b"collab-part-v3|"  # v3: parts digested with BLAKE3
_LIST_DOMAIN = b"collab-confirm-v1|"
MAX_CONFIRM_BYTES = 64 * 1024  # a signed list: ~330 bytes per part
MAX_LISTS = 256  # signed lists one collection holds (more than any group has members)
SIGNED_MEMORY = 65536  # (group, part) statements an owner remembers signing: hours of rounds


class SplitRound(RoundFailed):
    """Members of a round assembled different aggregates; nobody commits."""


class Unconfirmed(LeftBehind):
    """A member of the round did not answer the confirmation: those it did answer may have committed.
    ``peers``: the round's other members."""


def part_digest(
    group_id: str,
    j: int,
    wire: Payloads,
    excluded: Mapping[str, str],
    stats: Mapping[str, Sequence[float]] | None = None,
) -> str:
    """BLAKE3 (hex, 256 bits) of part ``j`` of a group's aggregate as its owner answered it: its bytes
    (``wire``, whole or in pieces), dropped list and, from a round's only owner, the (weight, norm) of
    each contribution it counted. (BLAKE3: 2.5x sha256's speed here, on parts of up to hundreds of MB.)"""
    h = blake3.blake3(_DOMAIN + f"{group_id}|{j}|".encode())
    h.update(json.dumps(sorted((str(k), str(v)) for k, v in excluded.items())).encode())
    if stats:
        h.update(
            b"|stats|"
            + json.dumps(sorted((str(k), [float(x) for x in v]) for k, v in stats.items())).encode()
        )
    for piece in pieces_of(wire):
        h.update(piece)
    return h.hexdigest()


@dataclass(frozen=True)
class Statement:
    """An owner's signed word on one part: its digest, the owner's public key and signature (hex)."""

    digest: str
    key: str
    signature: str

    def valid(self, group_id: str, j: int, owner: str) -> bool:
        """Signed for part ``j`` of group ``group_id`` by ``owner``: under the key its peer id names (a
        statement of another group, part or owner, however genuine, is not valid here)."""
        if self.key != peer_public_key(owner):
            return False
        try:
            Ed25519PublicKey.from_public_bytes(bytes.fromhex(self.key)).verify(
                bytes.fromhex(self.signature), _statement_message(group_id, j, self.digest)
            )
        except (ValueError, InvalidSignature):
            return False
        return True

    def to_wire(self) -> list[str]:
        return [self.digest, self.key, self.signature]

    @classmethod
    def from_wire(cls, raw: object) -> Statement | None:
        if not isinstance(raw, list) or len(raw) != 3:
            return None
        if not all(isinstance(x, str) and len(x) <= 256 for x in raw):
            return None
        return cls(str(raw[0]), str(raw[1]), str(raw[2]))


class Agreement:
    """Signs this peer's parts, checks the owners' statements, and runs the confirmation of a round."""

    def __init__(self, *, node: SwarmNode, timing: Timing, bans: Bans) -> None:
        self.node, self.timing, self.bans = node, timing, bans
        if node.identity is None:
            raise ValueError("this peer's libp2p identity is not an Ed25519 key: it cannot sign its rounds")
        self._key = node.identity  # the key its peer id names: its statements and lists are its own word
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        if peer_public_key(node.peer_key) != self.public:  # p2pd runs another key: all we sign would fail
            raise ValueError(f"peer id {node.peer_key} does not name this peer's identity key")
        self._collections: dict[str, _Collection] = {}  # group id -> the lists, as that round's collector
        self._signed: OrderedDict[tuple[str, int], str] = OrderedDict()  # (group id, part) -> digest signed
        self._pruned_at = 0.0  # when old collections were last dropped
        node.serve(CONFIRM, self._handle, max_payload=MAX_CONFIRM_BYTES)

    # ---- statements ---------------------------------------------------------------------------------
    def sign(self, group_id: str, j: int, digest: str) -> Statement:
        """This owner's statement on part ``j`` of group ``group_id``. Never two digests for one part: a
        leader that reuses a group id for a retried round (its nonce is the leader's to choose) would
        otherwise get an honest owner to sign two versions, which bans it (found on review)."""
        signed = self._signed.get((group_id, j))
        if signed is not None and signed != digest:
            raise RoundFailed(f"part {j} of group {group_id[:12]} was signed already: a reused group id")
        self._signed[(group_id, j)] = digest
        while len(self._signed) > SIGNED_MEMORY:
            self._signed.popitem(last=False)
        signature = self._key.sign(_statement_message(group_id, j, digest)).hex()
        return Statement(digest, self.public, signature)

    def check(self, group: Group, j: int, digest: str, raw: object, *, owner: str | None = None) -> Statement:
        """The owner of part ``j``'s (default ``group.owners[j]``) statement on the part this member
        received (``digest``); an owner that sent none, or one that does not match the part, is banned and
        the round fails."""
        owner = owner or group.owners[j]
        stmt = Statement.from_wire(raw)
        if stmt is None or stmt.digest != digest or not stmt.valid(group.group_id, j, owner):
            self.bans.ban(owner, "part without a valid signed statement", group.round_id)
            raise RoundFailed(f"part {j} from {owner[-6:]} carries no valid statement")
        return stmt

    # ---- confirmation -------------------------------------------------------------------------------
    def _collection(self, group_id: str) -> _Collection:
        coll = self._collections.get(group_id)
        if coll is None:
            coll = self._collections[group_id] = _Collection(asyncio.get_running_loop().create_future())
            now = time.monotonic()
            if now - self._pruned_at >= PRUNE_EVERY_S:
                self._pruned_at = now
                for old in [g for g, c in self._collections.items() if now - c.created > self._horizon_s(c)]:
                    self._collections.pop(old, None)
        return coll

    def _horizon_s(self, coll: _Collection) -> float:
        return self.timing.slot_horizon_s + (0.0 if coll.wait_s is None else 4 * coll.wait_s)

    def expect(self, group_id: str, timing: Timing) -> None:
        """This member's exchange of ``group_id`` starts, with the waits ``timing`` sized for its bytes:
        as the round's collector, give the others' lists that long (a member on a slow link finishes
        its exchange after the others by up to the time its bytes take)."""
        coll = self._collection(group_id)
        coll.wait_s = max(coll.wait_s or 0.0, timing.allreduce_s)

    async def _collected(self, coll: _Collection) -> dict[str, object]:
        """The collection's one outcome: all lists, or :class:`RoundFailed`. Whoever waits longer than
        ``allreduce_timeout_s`` decides the failure for everyone (an outcome is set only once)."""
        try:
            wait_s = coll.wait_s if coll.wait_s is not None else self.timing.allreduce_s
            await asyncio.wait_for(asyncio.shield(coll.outcome), wait_s)
        except TimeoutError:
            missing = sorted(p[-6:] for p in (coll.expected or set()) - set(coll.lists))
            coll.decide(f"no confirmation from {', '.join(missing) or 'the collector itself'}")
        why = coll.outcome.result()
        if why is not None:
            raise RoundFailed(why)
        assert coll.expected is not None
        return {p: coll.lists[p] for p in sorted(coll.expected)}

    async def _handle(self, header: Header, payload: Received, remote: str) -> tuple[Header, bytes]:
        """As the collector: take a member's signed list and answer with all of them (or the failure)."""
        coll = self._collection(str(header.get("group_id", ""))[:64])
        if remote not in coll.lists and len(coll.lists) >= MAX_LISTS:
            raise RuntimeError("too many confirmations for that group")
        mine = _signed_list_shape(bytes(payload))
        if mine is None:
            raise RuntimeError("malformed confirmation")
        coll.lists.setdefault(remote, mine)  # a member's first word stands
        coll.check_complete()
        lists = await self._collected(coll)
        if remote not in coll.peers:  # a member some owner dropped gets the lists too: it stays in sync
            raise RuntimeError("not a member of that round")
        return {}, json.dumps(lists).encode()

    def _signed_list(self, group_id: str, statements: Sequence[Statement]) -> dict[str, object]:
        parts = [s.to_wire() for s in statements]
        signature = self._key.sign(_list_message(group_id, parts)).hex()
        return {"parts": parts, "key": self.public, "signature": signature}

    async def confirm(
        self,
        group: Group,
        statements: Sequence[Statement],
        *,
        dropped: set[str],
        mine: str,
        timing: Timing | None = None,
        owners: Sequence[str] | None = None,
    ) -> None:
        """Return when every member still in the round (not ``dropped``) holds the same ``statements``;
        raise :class:`SplitRound` (banning whoever the statements name), :class:`Unconfirmed` (the
        collector did not answer) or :class:`RoundFailed`. ``owners``: the round's part owners (default
        ``group.owners``; a small round has one)."""
        owners = list(group.owners if owners is None else owners)
        members = [p for p in group.peers if p not in dropped]
        clients = set(group.clients)
        collectors = [p for p in members if p not in clients]  # a client cannot be called
        if len(owners) == 1:  # the only owner does not also collect: alone, it could hide a split it made
            not_owner = [p for p in collectors if p != owners[0]]
            if not not_owner and any(p not in clients and p != owners[0] for p in group.peers):
                raise RoundFailed(
                    f"round {group.round_id}: the only owner dropped every member that can collect"
                )
            collectors = not_owner or collectors
        if not collectors:
            raise RoundFailed(f"round {group.round_id}: no member left to collect the confirmations")
        collector, others = collectors[0], [p for p in members if p != mine]
        own = self._signed_list(group.group_id, statements)
        if collector == mine:
            coll = self._collection(group.group_id)
            coll.lists[mine] = own
            coll.peers, coll.expected = set(group.peers), set(members)
            coll.check_complete()
            try:
                lists: object = await self._collected(coll)
            except RoundFailed as e:  # a list never came: members whose view of the round differs (an
                # owner that told them other dropped lists) may have another collector, and commit
                raise Unconfirmed(str(e), others, self.timing.unconfirmed_s) from None
        else:
            try:
                _, payload = await self.node.call(
                    collector,
                    CONFIRM,
                    {"group_id": group.group_id},
                    json.dumps(own).encode(),
                    timeout_s=(timing or self.timing).part_call_s,
                )
            except RemoteError as e:  # an honest collector fails the round for all; a lying one may not
                raise Unconfirmed(
                    f"confirmation failed at {collector[-6:]}: {e}", others, self.timing.unconfirmed_s
                ) from None
            except TransportError as e:
                raise Unconfirmed(
                    f"no confirmation from {collector[-6:]}: {e}", others, self.timing.unconfirmed_s
                ) from None
            try:
                lists = json.loads(bytes(payload))
            except ValueError:
                lists = None
        try:
            self._judge(group, owners, statements, lists, members, direct=collector == mine)
        except SplitRound:
            if mine in members:  # every member's list is waited for: with a real split nobody commits
                raise
            raise Unconfirmed(
                f"round {group.round_id}: split seen by a dropped member", others, self.timing.unconfirmed_s
            ) from None
        except RoundFailed as e:
            if collector == mine:
                raise
            # a list missing or unverifiable: a lying collector may have given the others a full answer
            raise Unconfirmed(str(e), others, self.timing.unconfirmed_s) from None

    def _judge(
        self,
        group: Group,
        owners: Sequence[str],
        statements: Sequence[Statement],
        lists: object,
        members: list[str],
        *,
        direct: bool,
    ) -> None:
        """Commit (return) only when every member's signed list holds exactly ``statements``' digests.
        ``direct``: this member is the collector, so each list came straight from its member, and one
        that does not verify under the key that member signed its part with is that member's doing."""
        if not isinstance(lists, dict):
            raise RoundFailed(f"round {group.round_id}: malformed confirmation")
        split, unverified = [], []
        for peer, raw in lists.items():
            # every list counts only under the key its member's peer id names: nobody - a collector
            # least of all - can sign one in another member's name
            key = peer_public_key(peer) if peer in group.peers else None
            listed = _verified_parts(group.group_id, raw, key) if key is not None else None
            if listed is None:
                unverified.append(str(peer)[-6:])
                if direct and peer in group.peers:  # it came straight from that member
                    self.bans.ban(peer, "confirmation not signed with its peer id's key", group.round_id)
            elif not self._same(statements, listed):
                split.append(peer)
                self._blame(group, owners, statements, peer, listed)
        if split:
            raise SplitRound(
                f"round {group.round_id}: {', '.join(p[-6:] for p in split)} assembled another aggregate"
            )
        if unverified or set(lists) != set(members):
            raise RoundFailed(f"round {group.round_id}: unverifiable confirmation ({', '.join(unverified)})")

    @staticmethod
    def _same(statements: Sequence[Statement], listed: list[object]) -> bool:
        # the key too: an owner that signed the same digest under different keys for different members
        # could otherwise pass one member's check and fail another's
        return len(listed) == len(statements) and all(
            isinstance(x, list) and len(x) == 3 and x[0] == s.digest and x[1] == s.key
            for x, s in zip(listed, statements, strict=True)
        )

    def _blame(
        self,
        group: Group,
        owners: Sequence[str],
        statements: Sequence[Statement],
        peer: str,
        listed: list[object],
    ) -> None:
        """Ban whoever the signed words prove lied (each signed under its signer's peer id key, relayed or
        not): an owner that signed two versions of its part, or ``peer`` when its list claims a part
        without that owner's valid statement."""
        if len(listed) != len(statements):
            self.bans.ban(peer, "malformed confirmation", group.round_id)
            return
        for j, (raw, ours) in enumerate(zip(listed, statements, strict=True)):
            theirs = Statement.from_wire(raw)
            if theirs is not None and theirs.digest == ours.digest and theirs.key == ours.key:
                continue
            owner = owners[j]
            if theirs is None or not theirs.valid(group.group_id, j, owner):
                self.bans.ban(peer, f"confirmation of part {j} without its owner's statement", group.round_id)
            else:
                self.bans.ban(owner, f"signed two different versions of part {j}", group.round_id)


@dataclass
class _Collection:
    """The signed lists a collector gathered for one group, and its one outcome (``None``: complete, or
    why it failed)."""

    outcome: asyncio.Future[str | None]
    lists: dict[str, object] = field(default_factory=dict)
    expected: set[str] | None = None  # the members still in the round, once the collector knows them
    peers: set[str] = field(default_factory=set)  # the group's members, dropped ones included
    created: float = field(default_factory=time.monotonic)
    wait_s: float | None = None  # how long a list may keep the others waiting (sized for the round's bytes)

    def check_complete(self) -> None:
        if self.expected is not None and self.expected <= set(self.lists):
            self.decide(None)

    def decide(self, why: str | None) -> None:
        if not self.outcome.done():
            self.outcome.set_result(why)


def _statement_message(group_id: str, j: int, digest: str) -> bytes:
    return _DOMAIN + f"{group_id}|{j}|{digest}".encode()


def _list_message(group_id: str, parts: list[list[str]]) -> bytes:
    return _LIST_DOMAIN + f"{group_id}|".encode() + json.dumps(parts, separators=(",", ":")).encode()


def _signed_list_shape(payload: bytes | bytearray) -> dict[str, object] | None:
    """A signed list as sent (``parts``, ``key``, ``signature``; strings only), nothing else kept."""
    try:
        raw = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if not isinstance(raw, dict):
        return None
    parts, key, signature = raw.get("parts"), raw.get("key"), raw.get("signature")
    if not (isinstance(parts, list) and isinstance(key, str) and isinstance(signature, str)):
        return None
    if len(parts) > MAX_LISTS or not all(
        isinstance(x, list) and len(x) == 3 and all(isinstance(y, str) and len(y) <= 256 for y in x)
        for x in parts
    ):
        return None
    return {"parts": parts, "key": key[:256], "signature": signature[:256]}


def _verified_parts(group_id: str, raw: object, key: str) -> list[object] | None:
    """The statements a member's signed list holds, when the list is signed under ``key`` (the key its
    peer id names); ``None`` otherwise."""
    if not isinstance(raw, dict) or raw.get("key") != key:
        return None
    parts, signature = raw.get("parts"), raw.get("signature")
    if not isinstance(parts, list) or not isinstance(signature, str) or len(parts) > MAX_LISTS:
        return None
    if not all(isinstance(x, list) and all(isinstance(y, str) for y in x) for x in parts):
        return None
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(key)).verify(
            bytes.fromhex(signature), _list_message(group_id, parts)
        )
    except (ValueError, InvalidSignature):
        return None
    return list(parts)
