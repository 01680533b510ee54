"""Agreement before commit: every member of a round checks that all assembled the same aggregate.

The exact reducer makes the aggregate bit-identical on honest members only if every part owner sends the
same bytes to everyone. An owner that sends different bytes for its part to different members would split
the swarm's state. So, before a member applies a round's aggregate:

1. **Signed parts.** The owner of part ``j`` signs a statement ``(group id, j, sha256 of the part's bytes and
   of its list of dropped members)`` with a per-process Ed25519 key and sends it with the part; a member
   checks the signature when the part arrives (the key is what that owner gave it, over the authenticated
   libp2p stream).
2. **Confirmation.** Each member calls every other member that is still in the round (members some owner
   dropped are not) with ``collab.confirm``; the callee answers, once its own aggregate is assembled, with
   its per-part digests and the owners' statements it holds. A member commits only when every answer
   lists exactly its own digests.

Any difference fails the round for every member that sees it - all of them, since each member asks each
other. The statements name who split: a member that holds, under the key owner ``j`` gave it, two valid
signatures of ``j`` over different digests of part ``j`` bans ``j`` (it signed two different parts); a
member whose answer claims a digest without a valid statement of that owner is banned (it lied about what
it received). An owner that gave different members different keys is not attributable: the round fails
and nobody is banned. A member that does not answer fails the round for whoever asked it (it may have
died after answering others, who then commit): a member left :class:`Unconfirmed` first waits to see
whether any fellow member moves ahead, and then takes its state instead of redoing the step in another
group (which would split the swarm's lineage).

Cost per member and round: ``n - 1`` small calls (one digest and one 64-byte signature per part), one
signature and ``n`` verifications.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from collab.methods.base import RoundFailed
from collab.swarm.bans import Bans
from collab.swarm.matchmaking import Group
from collab.swarm.timing import Timing
from collab.swarm.transport import Header, SwarmNode, TransportError, gather_all

logger = logging.getLogger(__name__)

CONFIRM = "collab.confirm"
_DOMAIN = b"collab-part-v1|"


class SplitRound(RoundFailed):
    """Members of a round assembled different aggregates; nobody commits."""


class Unconfirmed(RoundFailed):
    """A member of the round did not answer the confirmation: those it did answer may have committed.
    ``peers``: the round's other members (see ``Catchup.after_unconfirmed``)."""

    def __init__(self, message: str, peers: Sequence[str]) -> None:
        super().__init__(message)
        self.peers = list(peers)


def part_digest(group_id: str, j: int, blob: bytes, excluded: Mapping[str, str]) -> str:
    """sha256 (hex) of part ``j`` of a group's aggregate as its owner answered it: bytes and dropped list."""
    h = hashlib.sha256(f"{group_id}|{j}|".encode())
    h.update(json.dumps(sorted((str(k), str(v)) for k, v in excluded.items())).encode())
    h.update(blob)
    return h.hexdigest()


@dataclass(frozen=True)
class Statement:
    """An owner's signed word on one part: its digest, the owner's public key and signature (hex)."""

    digest: str
    key: str
    signature: str

    def valid(self) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(bytes.fromhex(self.key)).verify(
                bytes.fromhex(self.signature), _DOMAIN + self.digest.encode()
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
        self._key = Ed25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        self._lists: dict[str, tuple[float, asyncio.Future[list[list[str]]]]] = {}  # group id -> ours
        node.serve(CONFIRM, self._handle)

    # ---- statements ---------------------------------------------------------------------------------
    def sign(self, digest: str) -> Statement:
        return Statement(digest, self.public, self._key.sign(_DOMAIN + digest.encode()).hex())

    def check(self, group: Group, j: int, digest: str, raw: object) -> Statement:
        """The owner of part ``j``'s statement on the part this member received (``digest``); an owner that
        sent none, or one that does not match the part, is banned and the round fails."""
        stmt = Statement.from_wire(raw)
        if stmt is None or stmt.digest != digest or not stmt.valid():
            owner = group.peers[j]
            self.bans.ban(owner, "part without a valid signed statement", group.round_id)
            raise RoundFailed(f"part {j} from {owner[-6:]} carries no valid statement")
        return stmt

    # ---- confirmation -------------------------------------------------------------------------------
    def _future(self, group_id: str) -> asyncio.Future[list[list[str]]]:
        entry = self._lists.get(group_id)
        if entry is None:
            entry = self._lists[group_id] = (time.monotonic(), asyncio.get_running_loop().create_future())
            horizon = time.monotonic() - self.timing.slot_horizon_s
            for old in [g for g, (t, _) in self._lists.items() if t < horizon]:
                self._lists.pop(old, None)
        return entry[1]

    async def _handle(self, header: Header, payload: bytes, remote: str) -> tuple[Header, bytes]:
        """Answer a fellow member with our statements once our aggregate is assembled."""
        group_id = str(header.get("group_id", ""))[:64]
        ours = self._future(group_id)
        try:
            listed = await asyncio.wait_for(asyncio.shield(ours), self.timing.allreduce_s)
        except TimeoutError:
            raise RuntimeError("no aggregate assembled for that group") from None
        return {"parts": listed}, b""

    async def confirm(
        self, group: Group, statements: Sequence[Statement], *, dropped: set[str], mine: str
    ) -> None:
        """Return when every member still in the round (not ``dropped``) holds the same ``statements``;
        raise :class:`SplitRound` (banning whoever the statements name) or :class:`RoundFailed`."""
        ours = self._future(group.group_id)
        if not ours.done():
            ours.set_result([s.to_wire() for s in statements])
        others = [p for p in group.peers if p != mine and p not in dropped]

        async def ask(peer: str) -> tuple[str, object]:
            try:
                answer, _ = await self.node.call(
                    peer, CONFIRM, {"group_id": group.group_id}, timeout_s=self.timing.part_call_s
                )
            except TransportError as e:
                raise Unconfirmed(f"no confirmation from {peer[-6:]}: {e}", others) from None
            return peer, answer.get("parts")

        answers = await gather_all([ask(p) for p in others])
        split = [(peer, listed) for peer, listed in answers if not self._same(statements, listed)]
        if not split:
            return
        for peer, listed in split:
            self._blame(group, statements, peer, listed)
        raise SplitRound(
            f"round {group.round_id}: {', '.join(p[-6:] for p, _ in split)} assembled another aggregate"
        )

    @staticmethod
    def _same(statements: Sequence[Statement], listed: object) -> bool:
        return (
            isinstance(listed, list)
            and len(listed) == len(statements)
            and all(
                isinstance(x, list) and len(x) == 3 and x[0] == s.digest
                for x, s in zip(listed, statements, strict=True)
            )
        )

    def _blame(self, group: Group, statements: Sequence[Statement], peer: str, listed: object) -> None:
        """Ban whoever the statements prove lied: an owner that signed two parts, or ``peer`` when its
        claims carry no valid statement of the owner (under the key that owner gave us)."""
        if not isinstance(listed, list) or len(listed) != len(statements):
            self.bans.ban(peer, "malformed confirmation", group.round_id)
            return
        for j, (raw, ours) in enumerate(zip(listed, statements, strict=True)):
            theirs = Statement.from_wire(raw)
            if theirs is not None and theirs.digest == ours.digest:
                continue
            owner = group.peers[j]
            if theirs is None or not theirs.valid() or (owner == peer and theirs.key != ours.key):
                self.bans.ban(peer, f"confirmation of part {j} without its owner's statement", group.round_id)
            elif theirs.key == ours.key:
                self.bans.ban(owner, f"signed two different versions of part {j}", group.round_id)
            else:
                logger.warning(
                    "round %s: part %d from %s came with two keys; nobody to blame",
                    group.round_id,
                    j,
                    owner[-6:],
                )
