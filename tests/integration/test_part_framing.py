"""An outsider cannot frame a member: parts sent in a member's name from another peer id are ignored.

Two real peers A and B form a group; before their round starts, a third peer X sends A two different
parts claiming to be B. A must average B's real part, drop nothing and ban nobody; both members must end
with the same bytes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from collab.compression import CompressedMessage, MessageKind
from collab.config import SwarmConfig
from collab.swarm.allreduce import PART, ExactReducer
from collab.swarm.matchmaking import Group
from collab.swarm.transport import SwarmNode, TransportError

NUMEL = 64


def _msg(scale: float) -> CompressedMessage:
    return CompressedMessage(MessageKind.DENSE, NUMEL, torch.linspace(-1, 1, NUMEL) * scale)


@pytest.mark.timeout(120)
def test_outsider_cannot_frame_a_member() -> None:
    cfg = SwarmConfig(allreduce_timeout_s=5.0)
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    x = SwarmNode(initial_peers=a.visible_maddrs())
    try:
        ra, rb = ExactReducer(node=a, cfg=cfg), ExactReducer(node=b, cfg=cfg)
        group = Group("7.delta", tuple(sorted([(0, a.peer_key), (1, b.peer_key)])), "nonce")
        j_a, j_b = group.index_of(a.peer_key), group.index_of(b.peer_key)
        header = {
            "group_id": group.group_id, "n": 2, "layout": "dense", "numel": NUMEL, "count": None,
            "shared_key": None, "sender": j_b, "weight": 1.0, "round": group.round_id, "part": j_a,
        }  # fmt: skip
        for scale in (1e3, -1e3):  # two different forged parts "from B": X's calls wait; ignore them
            with pytest.raises(TransportError):
                x.run(
                    x.call(a.peer_key, PART, header, _msg(scale).to_bytes(), timeout_s=0.5, retries=0),
                    timeout_s=5,
                )

        futures = [
            asyncio.run_coroutine_threadsafe(r.reduce(group, _msg(s), 1.0, "dense"), n._loop)
            for r, n, s in ((ra, a, 1.0), (rb, b, 2.0))
        ]
        out_a, out_b = (f.result(30) for f in futures)
        assert out_a.to_bytes() == out_b.to_bytes()
        assert torch.allclose(out_a.values, _msg(1.5).values)  # the honest average, nothing forged in it
        assert ra.last_excluded == {} and rb.last_excluded == {}
        assert not ra.bans.is_banned(b.peer_key) and not rb.bans.is_banned(a.peer_key)
    finally:
        for node in (x, b, a):
            node.shutdown()
