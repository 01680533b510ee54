"""Claimed samples are held to what the sender's device can have computed.

Three real peers form a group whose published bounds (rate and microbatch) allow each 10 samples in the
round. A claims 10 (honest), B claims 25 (a device that got faster than it published: counted at 10,
never banned), C claims 5000 (over ``max_weight_ratio`` times its bound: dropped and banned by every
honest owner, and told why). A and B end with the same bytes, and A's part is the equal-weight mean of
A's and B's parts. The same with parts of 2 MB, which owners validate and average on a worker thread, and
with a small round through one owner (the only one that sees, and bans, C).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from collab.compression import CompressedMessage, MessageKind
from collab.compression.partition import Layout
from collab.config import SwarmConfig
from collab.methods.base import RoundFailed
from collab.swarm.allreduce import ExactReducer, round_owners
from collab.swarm.matchmaking import Group
from collab.swarm.transport import SwarmNode


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("numel", "one_owner"),
    [(60, False), (60, True), (3 * 2**19, False)],  # small parts; one owner; parts averaged off the loop
)
def test_claims_over_the_published_bound_are_capped_or_banned(numel: int, one_owner: bool) -> None:
    def _msg(scale: float) -> CompressedMessage:
        return CompressedMessage(MessageKind.DENSE, numel, torch.linspace(-1, 1, numel) * scale)

    cfg = SwarmConfig(
        allreduce_timeout_s=5.0, max_weight_ratio=100.0, single_owner_bytes=1024 if one_owner else 0
    )
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    c = SwarmNode(initial_peers=a.visible_maddrs())
    nodes = (a, b, c)
    try:

        def claims(members: Sequence[str]) -> dict[str, float]:
            return dict.fromkeys(members, 10.0)

        reducers = [ExactReducer(node=n, cfg=cfg, claims=claims) for n in nodes]
        group = Group("3.delta", tuple(sorted((i, n.peer_key) for i, n in enumerate(nodes))), "nonce")
        sent = {a.peer_key: (_msg(1.0), 10.0), b.peer_key: (_msg(2.0), 25.0), c.peer_key: (_msg(1.5), 5e3)}
        futures = [
            asyncio.run_coroutine_threadsafe(r.reduce(group, *sent[n.peer_key], "dense"), n._loop)
            for r, n in zip(reducers, nodes, strict=True)
        ]
        outs = [f.result(30) for f in futures[:2]]
        assert outs[0].to_bytes() == outs[1].to_bytes()
        with pytest.raises(RoundFailed, match="can have done"):  # told why by the owners
            futures[2].result(30)

        ra, rb, _ = reducers
        owners = round_owners(group, sent[a.peer_key][0], Layout.DENSE, cfg.single_owner_bytes)
        assert len(owners) == (1 if one_owner else 3)
        for honest, node in ((ra, a), (rb, b)):
            assert set(honest.last_excluded) == {c.peer_key}
            assert "can have done" in honest.last_excluded[c.peer_key]
            # the owners checked C's claim themselves; a member that owns nothing has the owner's word
            assert honest.bans.is_banned(c.peer_key) == (node.peer_key in owners)
            assert not honest.bans.is_banned(a.peer_key) and not honest.bans.is_banned(b.peer_key)
        j = group.index_of(a.peer_key)
        size = numel // 3
        got = outs[0].values[j * size : (j + 1) * size]
        want = ((_msg(1.0).values + _msg(2.0).values) / 2)[j * size : (j + 1) * size]
        assert torch.allclose(got, want), "B's claim counts at its bound (10), like A's"
    finally:
        for node in reversed(nodes):
            node.shutdown()
