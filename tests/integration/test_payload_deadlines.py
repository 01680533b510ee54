"""A round's exchange waits grow with its payload: a dense round of a large vector that takes longer than
``allreduce_timeout_s`` on this machine's loopback completes, because its waits allow for its bytes at
``min_bandwidth_mb_s``; with the allowance taken away (an absurd bandwidth) the same round fails every
time, as a large refresh round did before (MASHA's refresh coin is the same on every retry)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from collab.compression import CompressedMessage, MessageKind
from collab.config import SwarmConfig
from collab.methods.base import RoundFailed
from collab.swarm.allreduce import ExactReducer, message_size
from collab.swarm.matchmaking import Group
from collab.swarm.timing import Timing
from collab.swarm.transport import SwarmNode

NUMEL = 16_000_000  # 64 MB per member: about a second of p2pd loopback traffic, far over 0.05 s


def _msg(scale: float) -> CompressedMessage:
    return CompressedMessage(MessageKind.DENSE, NUMEL, torch.full((NUMEL,), scale, dtype=torch.float32))


def _round(cfg: SwarmConfig, round_id: str) -> tuple[list[object], list[ExactReducer]]:
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    try:
        reducers = [ExactReducer(node=a, cfg=cfg), ExactReducer(node=b, cfg=cfg)]
        group = Group(round_id, tuple(sorted([(0, a.peer_key), (1, b.peer_key)])), "nonce")

        async def one(r: ExactReducer, scale: float) -> object:
            try:
                return await r.reduce(group, _msg(scale), 1.0, "dense")
            except RoundFailed as e:
                return e

        futures = [
            asyncio.run_coroutine_threadsafe(one(r, s), n._loop)
            for r, n, s in ((reducers[0], a, 1.0), (reducers[1], b, 3.0))
        ]
        wait_s = Timing.of(cfg).for_payload(4 * NUMEL).reduce_wait_s + 30
        return [f.result(wait_s) for f in futures], reducers
    finally:
        b.shutdown()
        a.shutdown()


@pytest.mark.timeout(300)
def test_a_large_round_gets_the_time_its_bytes_need() -> None:
    base = {"allreduce_timeout_s": 0.05, "max_message_bytes": 128 * 1024 * 1024}
    sized = SwarmConfig(**base, min_bandwidth_mb_s=5.0)  # 64 MB: about 51 s more
    assert Timing.of(sized).for_payload(message_size(_msg(1.0))).allreduce_s > 50
    outcome, reducers = _round(sized, "1.refresh")
    assert all(isinstance(o, CompressedMessage) for o in outcome), outcome
    first, second = outcome
    assert isinstance(first, CompressedMessage) and isinstance(second, CompressedMessage)
    assert first.to_bytes() == second.to_bytes() and float(first.values[0]) == 2.0
    # a round this large is measured: the next ones are sized by this peer's own rate as well
    assert all(r.link_b_s is not None and r.link_b_s > 0 for r in reducers)

    unsized = SwarmConfig(**base, min_bandwidth_mb_s=1e9)  # no allowance for the bytes
    outcome, _ = _round(unsized, "1.refresh")
    assert all(isinstance(o, RoundFailed) for o in outcome), outcome
