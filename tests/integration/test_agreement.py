"""The confirmation before commit, against hostile members and a hostile collector.

Three real peers (each its own p2pd) hold signed statements for the three parts of a round and run
``Agreement.confirm`` together: the first member still in the round collects every member's signed list
and answers all of them. Honest lists: everyone commits, a member some owner dropped included. An owner
that signed two versions of its part: nobody commits and everyone bans that owner. A member whose list is
not signed with its part's key: nobody commits and the collector (which got the list straight from it)
bans it. A collector that swaps one member's list for another's to hide a split: nobody commits, because
a list only counts under the key its member's peer id names. A small round's only owner that splits its
part: another member collects, everyone sees the split and bans the owner; with the collector in league,
the lists it makes up in other members' names do not verify, and nobody commits a split.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from collab.config import SwarmConfig
from collab.methods.base import RoundFailed
from collab.swarm.agreement import (
    Agreement,
    SplitRound,
    Statement,
    Unconfirmed,
    _list_message,
    _statement_message,
    part_digest,
)
from collab.swarm.bans import Bans
from collab.swarm.matchmaking import Group
from collab.swarm.timing import Timing
from collab.swarm.transport import SwarmNode, write_identity

TIMING = Timing.of(SwarmConfig(allreduce_timeout_s=3.0))


def signed_anyway(owner: Agreement, group_id: str, j: int, blob: bytes) -> Statement:
    """``owner``'s statement on part ``j`` made past :meth:`Agreement.sign`'s refusal of a second version."""
    digest = part_digest(group_id, j, blob, {})
    return Statement(digest, owner.public, owner._key.sign(_statement_message(group_id, j, digest)).hex())


class Round:
    """Three members, their agreements and the statements each holds (``held[member][part]``)."""

    def __init__(self, nodes: list[SwarmNode], tag: str, *, parts: int | None = None) -> None:
        self.nodes = {n.peer_key: n for n in nodes}
        self.agreements = {
            k: Agreement(node=n, timing=TIMING, bans=Bans(duration_s=60.0, me=k))
            for k, n in self.nodes.items()
        }
        self.group = Group(f"{tag}.delta", tuple(sorted((i, n.peer_key) for i, n in enumerate(nodes))), tag)
        self.peers = self.group.peers
        self.owners = self.peers[: parts or len(self.peers)]  # a small round has one owner
        honest = [self.statement(j, f"part {j}".encode()) for j in range(len(self.owners))]
        self.held = {p: list(honest) for p in self.peers}
        self.dropped: set[str] = set()  # members some owner dropped (in every owner's statement)

    def statement(self, j: int, blob: bytes) -> Statement:
        owner = self.agreements[self.peers[j]]
        return owner.sign(self.group.group_id, j, part_digest(self.group.group_id, j, blob, {}))

    def second_version(self, j: int, blob: bytes) -> Statement:
        """What a hostile owner of part ``j`` signs besides its first version (an honest one refuses)."""
        return signed_anyway(self.agreements[self.peers[j]], self.group.group_id, j, blob)

    def confirm_all(self, silent: frozenset[str] = frozenset()) -> dict[str, BaseException | None]:
        """Every member (but the ``silent`` ones) confirms at once; ``None``: it would commit."""

        def one(peer: str) -> BaseException | None:
            coro = self.agreements[peer].confirm(
                self.group, self.held[peer], dropped=self.dropped, mine=peer, owners=self.owners
            )
            try:
                self.nodes[peer].run(coro, timeout_s=30)
            except RoundFailed as e:
                return e
            return None

        speaking = [p for p in self.peers if p not in silent]
        with ThreadPoolExecutor(len(speaking)) as pool:
            return dict(zip(speaking, pool.map(one, speaking), strict=True))

    def banned(self) -> dict[str, set[str]]:
        return {p: set(a.bans.active_peers()) for p, a in self.agreements.items()}


@pytest.fixture
def make_round(node_trio: Callable[[], list[SwarmNode]]) -> Callable[..., Round]:
    """Three fresh peers (each with its own p2pd) for one round; all shut down after the test."""
    return lambda tag, parts=None: Round(node_trio(), tag, parts=parts)


@pytest.mark.timeout(120)
def test_honest_members_all_commit(make_round: Callable[[str], Round]) -> None:
    r = make_round("1")
    assert r.confirm_all() == dict.fromkeys(r.peers)
    assert r.banned() == {p: set() for p in r.peers}


@pytest.mark.timeout(120)
def test_a_dropped_member_commits_with_the_others(make_round: Callable[[str], Round]) -> None:
    r = make_round("5")
    r.dropped = {r.peers[2]}  # its contribution missed the round: its list is not waited for
    assert r.confirm_all() == dict.fromkeys(r.peers), "it applies the same aggregate and stays in sync"


@pytest.mark.timeout(120)
def test_a_missing_list_leaves_every_member_unconfirmed(make_round: Callable[[str], Round]) -> None:
    r = make_round("6")
    outcome = r.confirm_all(silent=frozenset({r.peers[2]}))  # a member that never sends its list
    # nobody commits; the collector too first looks for members that may have (see Catchup.follow)
    assert all(isinstance(e, Unconfirmed) for e in outcome.values()), outcome
    assert r.peers[0] in outcome and r.banned() == {p: set() for p in r.peers}


@pytest.mark.timeout(120)
def test_an_owner_that_signed_two_versions_is_banned_by_everyone(make_round: Callable[[str], Round]) -> None:
    r = make_round("2")
    owner, victim = r.peers[1], r.peers[2]
    r.held[victim][1] = r.second_version(1, b"another part 1")  # the owner sent the victim other bytes
    outcome = r.confirm_all()
    assert all(isinstance(e, SplitRound) for e in outcome.values()), outcome
    assert all(owner in bans for p, bans in r.banned().items() if p != owner), r.banned()


@pytest.mark.timeout(120)
def test_a_list_not_signed_with_the_part_key_fails_and_the_collector_bans(
    make_round: Callable[[str], Round], monkeypatch: pytest.MonkeyPatch
) -> None:
    r = make_round("3")
    collector, liar = r.peers[0], r.peers[2]
    honest_list = r.agreements[liar]._signed_list

    def unsigned(group_id: str, statements: Any) -> dict[str, object]:
        return {**honest_list(group_id, statements), "signature": "00" * 64}

    monkeypatch.setattr(r.agreements[liar], "_signed_list", unsigned)
    outcome = r.confirm_all()
    assert all(isinstance(e, RoundFailed) and not isinstance(e, SplitRound) for e in outcome.values())
    assert r.banned()[collector] == {liar}
    assert r.banned()[r.peers[1]] == set(), "to a member the collector may have tampered: no ban"


@pytest.mark.timeout(120)
def test_a_collector_cannot_hide_a_split(
    make_round: Callable[[str], Round], monkeypatch: pytest.MonkeyPatch
) -> None:
    r = make_round("4")
    collector, honest, victim = r.peers
    r.held[victim][1] = r.second_version(1, b"another part 1")  # owner 1 splits ...
    coll = r.agreements[collector]
    collected = coll._collected

    async def hiding(c: Any) -> dict[str, object]:  # ... and the collector shows everyone agreeing
        lists = await collected(c)
        return {**lists, victim: lists[honest]}

    monkeypatch.setattr(coll, "_collected", hiding)
    outcome = r.confirm_all()
    assert all(e is not None for e in outcome.values()), f"a member committed: {outcome}"
    assert not isinstance(outcome[honest], SplitRound), "the honest member sees an unverifiable list"
    assert isinstance(outcome[victim], SplitRound), "the victim still sees the others' lists differ"


@pytest.mark.timeout(120)
def test_a_replayed_statement_frames_nobody_but_its_replayer(make_round: Callable[[str], Round]) -> None:
    r = make_round("6")
    owner, liar = r.peers[1], r.peers[2]
    # a genuine statement of the owner, from another round: valid there, not here
    old = r.agreements[owner].sign("another-group", 1, part_digest("another-group", 1, b"old part", {}))
    r.held[liar][1] = old
    outcome = r.confirm_all()
    assert all(e is not None for e in outcome.values()), f"a member committed: {outcome}"
    banned = r.banned()
    honest_views = [bans for p, bans in banned.items() if p != liar]  # what the liar does is its own
    assert all(owner not in bans for bans in honest_views), f"the owner was framed: {banned}"
    assert all(liar in bans for p, bans in banned.items() if p != liar), banned


@pytest.mark.timeout(120)
def test_the_only_owner_of_a_small_round_cannot_hide_its_split(make_round: Callable[..., Round]) -> None:
    r = make_round("7", parts=1)
    owner, collector, victim = r.peers
    r.held[victim][0] = r.second_version(0, b"another part 0")  # the only owner sent the victim other bytes
    outcome = r.confirm_all()
    # the owner does not collect (alone it could show each member its own version): another member does
    assert all(isinstance(e, SplitRound) for e in outcome.values()), outcome
    assert all(owner in bans for p, bans in r.banned().items() if p != owner), r.banned()
    assert collector not in r.banned()[victim]
    assert r.group.group_id in r.agreements[collector]._collections
    assert r.group.group_id not in r.agreements[owner]._collections, "the owner collected"


@pytest.mark.timeout(120)
def test_a_collector_cannot_frame_a_member_that_owns_no_part(
    make_round: Callable[..., Round], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collector that makes up a list in an honest member's name (signed with a key of its own, which
    the list names) fails the round, and nobody bans that member for it: the list does not verify under
    the key the member's peer id names."""
    r = make_round("8", parts=1)
    _, collector, honest = r.peers
    coll = r.agreements[collector]
    collected = coll._collected

    key = Ed25519PrivateKey.generate()  # the collector's own, named in the list it makes up
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    claim = [["ab" * 32, public, "00" * 64]]  # a digest of part 0 without the owner's statement
    made_up = {
        "parts": claim,
        "key": public,
        "signature": key.sign(_list_message(r.group.group_id, claim)).hex(),
    }

    async def forging(c: Any) -> dict[str, object]:
        return {**(await collected(c)), honest: made_up}  # what "honest" never signed

    monkeypatch.setattr(coll, "_collected", forging)
    outcome = r.confirm_all()
    assert all(e is not None for e in outcome.values()), f"a member committed: {outcome}"
    banned = r.banned()
    assert all(honest not in bans for p, bans in banned.items() if p != collector), (
        banned
    )  # its own are its own


@pytest.mark.timeout(120)
def test_an_only_owner_that_drops_every_other_member_cannot_collect(make_round: Callable[..., Round]) -> None:
    r = make_round("9", parts=1)
    owner, a, b = r.peers
    r.dropped = {a, b}  # what its answers would say: left alone, it would collect its own confirmation
    outcome = r.confirm_all()
    assert isinstance(outcome[owner], RoundFailed) and "dropped every member" in str(outcome[owner])


@pytest.mark.timeout(120)
def test_the_only_owner_and_the_collector_together_cannot_split_two_members(
    make_round: Callable[..., Round], tmp_path: Path
) -> None:
    """A small round's only owner gives two members two versions of the aggregate, and the collector (in
    league with it) shows each member a list in the other's name that agrees with its own version. Every
    list counts only under the key its member's peer id names, so the made-up lists do not verify: the
    member fails the round instead of committing (before the binding it committed, and the two members'
    states split). The other member's real list shows the split and bans the owner."""
    r = make_round("10", parts=1)
    owner, collector, member = r.peers
    other_key = Ed25519PrivateKey.generate()  # a fourth member; its p2pd is not needed to judge lists
    other = write_identity(str(tmp_path / "other.key"), other_key)
    group = Group(r.group.round_id, tuple(sorted([*r.group.members, (3, other)])), "10")
    gid = group.group_id

    def version(blob: bytes) -> Statement:
        return r.agreements[owner].sign(gid, 0, part_digest(gid, 0, blob, {}))

    def signed(key: Ed25519PrivateKey, held: list[Statement]) -> dict[str, object]:
        parts = [s.to_wire() for s in held]
        public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        return {"parts": parts, "key": public, "signature": key.sign(_list_message(gid, parts)).hex()}

    a = version(b"version A")  # what `member` got; `other` got B
    b = signed_anyway(r.agreements[owner], gid, 0, b"version B")
    lists = {p: r.agreements[p]._signed_list(gid, [a]) for p in (owner, collector, member)}
    forger = Ed25519PrivateKey.generate()  # the collector's own key, named in the list it makes up

    def judge(other_list: dict[str, object]) -> RoundFailed | None:
        try:
            r.agreements[member]._judge(
                group, [owner], [a], {**lists, other: other_list}, group.peers, direct=False
            )
        except RoundFailed as e:
            return e
        return None

    made_up = judge(signed(forger, [a]))
    assert made_up is not None and not isinstance(made_up, SplitRound), "a made-up list let the member commit"
    assert judge(signed(other_key, [a])) is None, "the member's own key: its list counts"
    assert isinstance(judge(signed(other_key, [b])), SplitRound)
    assert owner in r.banned()[member], "two signed versions of one part: the owner is banned"


@pytest.mark.timeout(120)
def test_an_owner_never_signs_two_versions_of_one_part(make_round: Callable[..., Round]) -> None:
    """A leader chooses the group's nonce: one that reuses a group id for a retried round could get an
    honest owner to sign two versions of a part, and have it banned for them. It signs one per part."""
    r = make_round("11")
    owner = r.agreements[r.peers[0]]
    gid = "reused-group-id"
    first = owner.sign(gid, 0, part_digest(gid, 0, b"first attempt", {}))
    assert owner.sign(gid, 0, first.digest) == first, "the same part again: the same statement"
    with pytest.raises(RoundFailed, match="signed already"):
        owner.sign(gid, 0, part_digest(gid, 0, b"the retried round's part", {}))
    owner.sign(gid, 1, part_digest(gid, 1, b"another part", {}))  # other parts are other statements
