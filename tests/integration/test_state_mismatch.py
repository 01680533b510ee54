"""Guards against a swarm split by two groups at one step. Two peers at the same step with different states
never average together: the leader refuses the joiner, which learns whose state to adopt. A group never
forms for a round that enough peers for a group already committed (their alive records are past it): its
members catch up by download instead of committing a second version of the round. And a peer that comes
to a group after it closed waits for that group's state rather than redo the round with other latecomers
(seen with 16 peers: two slow members of a steady-state group committed a second version of its round)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import torch

from collab.compression import CompressedMessage, Identity
from collab.config import SwarmConfig
from collab.methods.base import Contribution, RoundFailed, RoundKey
from collab.swarm.aggregator import SwarmAggregator
from collab.swarm.matchmaking import Group, LeftBehind, Matchmaker, StateMismatch
from collab.swarm.records import AliveRecord, PeerStatus
from collab.swarm.transport import SwarmNode


@pytest.mark.timeout(120)
def test_leader_refuses_a_joiner_with_another_state() -> None:
    cfg = SwarmConfig(min_group_size=2, min_matchmaking_time_s=0.5, matchmaking_timeout_s=4.0)
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    try:
        makers = {}
        for node, device, state in ((a, 0, "hash-A"), (b, 1, "hash-B")):
            mm = Matchmaker(node=node, run_id="split", cfg=cfg, device_index=device, config_version="v")
            mm.state_hash = lambda state=state: state
            training = AliveRecord(step=3, status=PeerStatus.TRAINING)
            mm.alive_peers = {a.peer_key: training, b.peer_key: training}
            makers[node.peer_key] = mm
        leader, joiner = sorted(makers)

        outcome = dict(zip([a.peer_key, b.peer_key], a.run(_gather(a, b, makers), timeout_s=30), strict=True))
        failure = outcome[joiner]
        assert isinstance(failure, StateMismatch) and failure.peer == leader, outcome
        assert not isinstance(outcome[leader], StateMismatch)  # the leader keeps its state (its group fails)
    finally:
        b.shutdown()
        a.shutdown()


@pytest.mark.timeout(120)
def test_peers_of_another_wire_protocol_never_group() -> None:
    """Same config, another wire protocol (e.g. an older collab with other part digests): the two would
    check each other's statements against different digests and ban each other. Neither joins the other."""
    cfg = SwarmConfig(min_group_size=2, min_matchmaking_time_s=0.5, matchmaking_timeout_s=3.0)
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    try:
        makers = {}
        for node, device in ((a, 0), (b, 1)):
            mm = Matchmaker(node=node, run_id="wire", cfg=cfg, device_index=device, config_version="v")
            training = AliveRecord(step=3, status=PeerStatus.TRAINING)
            mm.alive_peers = {a.peer_key: training, b.peer_key: training}
            makers[node.peer_key] = mm
        makers[b.peer_key]._join_version = "v/wire2"  # what an older peer compares
        outcome = a.run(_gather(a, b, makers), timeout_s=30)
        assert all(isinstance(o, RoundFailed) for o in outcome), outcome  # no group of two formed
        assert any("runs config v/wire" in str(o) for o in outcome), outcome  # the joiner was told why
    finally:
        b.shutdown()
        a.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("round_id", "ours", "theirs", "learned"),
    [
        ("3.delta", 3, 4, "before"),  # two others finished step 3: a second group of it would split the run
        ("3.delta", 3, 4, "while forming"),  # their records arrive while the group forms: it never closes
        ("0.init", -1, 0, "before"),  # two others hold an initial state: a second initial round would split
        ("3.delta", 3, 3, "before"),  # the others are at our step: they may come, the round goes on
    ],
)
def test_no_group_for_a_round_others_committed(round_id: str, ours: int, theirs: int, learned: str) -> None:
    cfg = SwarmConfig(min_group_size=2, min_matchmaking_time_s=0.5, matchmaking_timeout_s=4.0)
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    try:
        makers = {}
        for node, device in ((a, 0), (b, 1)):
            makers[node.peer_key] = Matchmaker(
                node=node, run_id="past", cfg=cfg, device_index=device, config_version="v"
            )

        def view(step: int) -> None:  # two peers the view knows by their records only (they never answer)
            others = {
                f"12D3KooWzzzzOther{i}": AliveRecord(step=step, status=PeerStatus.TRAINING) for i in (1, 2)
            }
            mine = AliveRecord(step=ours, status=PeerStatus.TRAINING)
            for mm in makers.values():
                mm.alive_peers = {a.peer_key: mine, b.peer_key: mine, **others}

        view(ours if learned == "while forming" else theirs)
        later = (lambda: view(theirs)) if learned == "while forming" else None
        results = a.run(_gather(a, b, makers, round_id, later), timeout_s=30)
        outcome = dict(zip([a.peer_key, b.peer_key], results, strict=True))
        if theirs == ours:
            assert all(isinstance(o, Group) and len(o) == 2 for o in outcome.values()), outcome
        else:
            leader = min(outcome)
            assert isinstance(outcome[leader], RoundFailed), outcome
            assert "already committed" in str(outcome[leader]), outcome
            assert all(isinstance(o, RoundFailed) for o in outcome.values()), outcome
    finally:
        b.shutdown()
        a.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["usual", "steady, a member missing", "steady, a suspect alive"])
def test_a_peer_late_for_a_closed_group_waits_for_its_state(path: str) -> None:
    """Leader L and member M form round 3.delta (the usual way, or on the steady-state path where nobody
    reads announcements); latecomer X, alive in their view, then tries the round the usual way. It must find
    L (a steady-state leader closing without an alive peer announces the round) and be told it was left
    out: LeftBehind, following L - not fail plainly and then lead a second group of the round with other
    latecomers. On the steady path X is a member of the last group that is late, or a peer L and M suspect
    (it is not waited for, and the group fills at once)."""
    cfg = SwarmConfig(
        min_group_size=2,
        target_group_size=2 if path == "usual" else None,
        min_matchmaking_time_s=0.3,
        matchmaking_timeout_s=4.0,
    )
    nodes = [SwarmNode()]
    nodes += [SwarmNode(initial_peers=nodes[0].visible_maddrs()) for _ in range(2)]
    try:
        leader, member, late = sorted(n.peer_key for n in nodes)
        by_key = {n.peer_key: n for n in nodes}
        makers = {}
        training = AliveRecord(step=3, status=PeerStatus.TRAINING)
        for i, node in enumerate(nodes):
            run_id = "late-" + "".join(c for c in path if c.isalpha())
            mm = Matchmaker(node=node, run_id=run_id, cfg=cfg, device_index=i, config_version="v")
            mm.state_hash = lambda: "same"
            mm.alive_peers = {p: training for p in (leader, member, late)}
            if path == "steady, a member missing" and node.peer_key != late:
                mm.remember_group([leader, member, late])
            if path == "steady, a suspect alive" and node.peer_key != late:
                mm.suspect(late)
                mm.remember_group([leader, member])
            makers[node.peer_key] = mm
        a, b = by_key[leader], by_key[member]
        groups = a.run(_gather(a, b, makers), timeout_s=30)
        assert all(isinstance(g, Group) and set(g.peers) == {leader, member} for g in groups), groups

        x = by_key[late]
        with pytest.raises(LeftBehind) as left:
            x.run(makers[late].form_group("3.delta"), timeout_s=30)
        assert left.value.peers == [leader], left.value
    finally:
        for n in reversed(nodes):
            n.shutdown()


@pytest.mark.timeout(120)
def test_a_steady_round_that_fills_at_once_stores_nothing() -> None:
    """Every alive peer is in the last group: the steady-state leader announces a round only when its group
    is slow to fill (a signed DHT store per round, replicated to every DHT node, was most of a small
    model's DHT load). Of 8 steady rounds of two peers on 127.0.0.1, some leave no announcement (the old
    code announced all 8; a busy machine may make a few slow to fill)."""
    cfg = SwarmConfig(min_group_size=2, min_matchmaking_time_s=0.3, matchmaking_timeout_s=4.0)
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    try:
        makers = {}
        training = AliveRecord(step=3, status=PeerStatus.TRAINING)
        for i, node in enumerate((a, b)):
            mm = Matchmaker(node=node, run_id="steady-quiet", cfg=cfg, device_index=i, config_version="v")
            mm.state_hash = lambda: "same"
            mm.alive_peers = {p: training for p in (a.peer_key, b.peer_key)}
            mm.remember_group([a.peer_key, b.peer_key])
            makers[node.peer_key] = mm
        announced = 0
        for step in range(3, 11):
            groups = a.run(_gather(a, b, makers, f"{step}.delta"), timeout_s=30)
            assert all(isinstance(g, Group) and len(g) == 2 for g in groups), groups
            if a.get_dict(f"steady-quiet_round_{step}.delta", timeout_s=10):
                announced += 1
        assert announced <= 6, f"{announced} of 8 steady rounds announced"
    finally:
        b.shutdown()
        a.shutdown()


@pytest.mark.timeout(120)
def test_a_member_whose_exchange_times_out_waits_for_the_group() -> None:
    """A member whose exchange outlives its whole limit (a stalled machine, a confirmation that never came
    back) may have had its parts used by the others, who then commit: it must not redo the round apart, so
    it is left behind (Unconfirmed, naming the others), not plainly failed."""
    cfg = SwarmConfig(
        min_group_size=2, min_matchmaking_time_s=0.3, matchmaking_timeout_s=4.0, allreduce_timeout_s=0.5
    )
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    try:
        aggs = {}
        training = AliveRecord(step=3, status=PeerStatus.TRAINING)
        for node, device in ((a, 0), (b, 1)):
            agg = SwarmAggregator(node=node, run_id="stall", cfg=cfg, device_index=device, shared_seed=1)
            agg.matchmaker.alive_peers = {a.peer_key: training, b.peer_key: training}
            aggs[node.peer_key] = agg

        async def stalled(*args: object, **kwargs: object) -> CompressedMessage:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        aggs[a.peer_key].reducer.reduce = stalled  # type: ignore[method-assign]
        outcome: dict[str, BaseException | None] = {}

        def member(key: str) -> None:
            message = Identity().compress(torch.ones(8))
            try:
                aggs[key].reduce(RoundKey(3, "delta"), [Contribution(message, 1.0)], lambda m: m)
                outcome[key] = None
            except BaseException as e:
                outcome[key] = e

        threads = [threading.Thread(target=member, args=(k,)) for k in aggs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stuck = outcome[a.peer_key]
        assert isinstance(stuck, LeftBehind) and stuck.peers == [b.peer_key], outcome
        assert isinstance(outcome[b.peer_key], RoundFailed), outcome  # never got a's parts
    finally:
        b.shutdown()
        a.shutdown()


async def _gather(
    a: SwarmNode,
    b: SwarmNode,
    makers: dict[str, Matchmaker],
    round_id: str = "3.delta",
    later: Callable[[], None] | None = None,
) -> list[object]:
    """Both peers try to form ``round_id`` at once (each on its own node's loop); ``later`` runs a moment
    after they started (before the leader may close)."""
    futures = []
    for n in (a, b):
        coro = makers[n.peer_key].form_group(round_id)
        futures.append(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, n._loop)))
    if later is not None:
        await asyncio.sleep(0.2)
        later()
    return await asyncio.gather(*futures, return_exceptions=True)
