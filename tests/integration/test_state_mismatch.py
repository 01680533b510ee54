"""Two peers at the same step with different states never average together: the leader refuses the
joiner, which learns whose state to adopt (guards against a swarm split by two groups at one step)."""

from __future__ import annotations

import asyncio

import pytest

from collab.config import SwarmConfig
from collab.swarm.matchmaking import Matchmaker, StateMismatch
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


async def _gather(a: SwarmNode, b: SwarmNode, makers: dict[str, Matchmaker]) -> list[object]:
    """Both peers try to form round 3.delta at once (each on its own node's loop)."""
    futures = []
    for n in (a, b):
        coro = makers[n.peer_key].form_group("3.delta")
        futures.append(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, n._loop)))
    return await asyncio.gather(*futures, return_exceptions=True)
