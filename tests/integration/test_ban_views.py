"""Peers whose views of bans differ. The peer that bans the others' leader stays out of their group, and
that group never waits for it: it tells the banned leader so (a join naming the ban, answered
``conflict``). Redirected to that leader, it is left out at once and follows the group's state by
download; when its own view makes it a leader, its round fails on its own."""

from __future__ import annotations

import asyncio
import time

import pytest

from collab.config import SwarmConfig
from collab.methods.base import RoundFailed
from collab.swarm.matchmaking import Group, LeftBehind, Matchmaker
from collab.swarm.records import AliveRecord, PeerStatus
from collab.swarm.transport import SwarmNode


@pytest.mark.timeout(120)
@pytest.mark.parametrize("accuser_key", ["largest", "middle"])
def test_a_peer_that_bans_the_leader_never_holds_up_its_group(accuser_key: str) -> None:
    cfg = SwarmConfig(min_group_size=2, min_matchmaking_time_s=0.5, matchmaking_timeout_s=4.0)
    first = SwarmNode()
    nodes = [
        first,
        SwarmNode(initial_peers=first.visible_maddrs()),
        SwarmNode(initial_peers=first.visible_maddrs()),
    ]
    try:
        nodes.sort(key=lambda n: n.peer_key)  # the smallest key leads the round
        leader, follower, accuser = nodes if accuser_key == "largest" else (nodes[0], nodes[2], nodes[1])
        makers = {
            n.peer_key: Matchmaker(node=n, run_id="views", cfg=cfg, device_index=i, config_version="v")
            for i, n in enumerate(nodes)
        }
        view = {n.peer_key: AliveRecord(step=3, status=PeerStatus.TRAINING) for n in nodes}
        for mm in makers.values():
            mm.alive_peers = dict(view)
        makers[accuser.peer_key].bans.ban(leader.peer_key, "test: an invalid part")

        async def gather() -> list[tuple[object, float]]:
            async def timed(n: SwarmNode) -> tuple[object, float]:
                start = time.monotonic()
                try:
                    out: object = await makers[n.peer_key].form_group("3.delta")
                except Exception as e:  # the outcome is what the test checks
                    out = e
                return out, time.monotonic() - start

            futures = [
                asyncio.wrap_future(asyncio.run_coroutine_threadsafe(timed(n), n._loop)) for n in nodes
            ]
            return await asyncio.gather(*futures)

        outcome = dict(zip((n.peer_key for n in nodes), first.run(gather(), timeout_s=30), strict=True))
        (led, _), (followed, _) = outcome[leader.peer_key], outcome[follower.peer_key]
        left, waited = outcome[accuser.peer_key]
        assert isinstance(led, Group) and isinstance(followed, Group), (led, followed)
        assert led.peers == followed.peers == sorted([leader.peer_key, follower.peer_key]), led
        if accuser_key == "middle":  # it leads a group of its own, which nobody joins
            assert isinstance(left, RoundFailed) and "only 1 peer" in str(left), left
            return
        assert isinstance(left, LeftBehind), left
        assert "banned here" in str(left) and follower.peer_key in left.peers, left
        # at once: not at the round's deadline (asking the follower again and again until then)
        assert waited < cfg.matchmaking_timeout_s / 2, waited
    finally:
        for n in reversed(nodes):
            n.shutdown()
