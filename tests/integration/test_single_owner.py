"""Small rounds go through one owner: fewer calls, the same bytes, and an owner that cannot inflate them.

Three real peers (each its own p2pd) reduce a 60-value message. Under ``single_owner_bytes`` the first
member owns the only part: every member ends with the same bytes, equal to the weighted mean of all three
messages computed in one process, and nobody but the owner keeps a part slot. The only owner publishes
(weight, norm) of each contribution it counted, inside its signed digest; a member checks its own entry
and that the aggregate's norm is within the weighted mean of those norms. An owner that inflates the
aggregate is banned by both other members; so is one that also inflates its account to cover it (each
member finds its own entry wrong), and one whose own contribution, which nobody else checks, is an
outlier against the account.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from collab.compression import CompressedMessage, MessageKind, weighted_mean
from collab.compression.clip import PartClipping
from collab.compression.partition import Layout
from collab.config import SwarmConfig
from collab.methods.base import Contribution, RoundFailed, RoundKey
from collab.methods.simulated import SimulatedAggregator
from collab.swarm.allreduce import ExactReducer, _Reduced, round_owners
from collab.swarm.matchmaking import Group
from collab.swarm.transport import SwarmNode

NUMEL = 60
WEIGHTS = (1.0, 2.0, 3.0)
CFG = SwarmConfig(allreduce_timeout_s=2.0)


def _msg(i: int) -> CompressedMessage:
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + i))
    return CompressedMessage(MessageKind.DENSE, NUMEL, values)


class Trio:
    def __init__(self, nodes: list[SwarmNode], tag: str, cfg: SwarmConfig = CFG) -> None:
        self.nodes = nodes
        self.reducers = [ExactReducer(node=n, cfg=cfg) for n in nodes]
        self.group = Group(f"{tag}.delta", tuple((i, n.peer_key) for i, n in enumerate(nodes)), tag)

    def reduce_all(
        self, scale: tuple[float, ...] = (1.0, 1.0, 1.0)
    ) -> list[CompressedMessage | BaseException]:
        futures = [
            asyncio.run_coroutine_threadsafe(
                r.reduce(self.group, replace(_msg(i), values=_msg(i).values * scale[i]), WEIGHTS[i], "dense"),
                n._loop,
            )
            for i, (r, n) in enumerate(zip(self.reducers, self.nodes, strict=True))
        ]
        out: list[CompressedMessage | BaseException] = []
        for f in futures:
            try:
                out.append(f.result(30))
            except RoundFailed as e:
                out.append(e)
        return out


@pytest.fixture
def make_trio(node_trio: Callable[[], list[SwarmNode]]) -> Callable[[str], Trio]:
    def make(tag: str) -> Trio:
        nodes = node_trio()
        trio = Trio(nodes, tag)
        # canonical order is (device, key): device indices 0, 1, 2 make nodes[0] the owner
        assert round_owners(trio.group, _msg(0), Layout.DENSE, CFG.single_owner_bytes) == [nodes[0].peer_key]
        return trio

    return make


@pytest.mark.timeout(120)
def test_a_small_round_has_one_owner_and_the_exact_mean(make_trio: Callable[[str], Trio]) -> None:
    trio = make_trio("1")
    outs = trio.reduce_all()
    assert all(isinstance(o, CompressedMessage) for o in outs), outs
    want = weighted_mean([_msg(i) for i in range(3)], list(WEIGHTS))
    assert all(o.to_bytes() == want.to_bytes() for o in outs if isinstance(o, CompressedMessage))
    for r in trio.reducers:  # one part: nobody ever held a slot for a second one
        assert {j for _, j in r._slots} <= {0}
    assert all(not r.bans.active_peers() for r in trio.reducers)
    assert round_owners(trio.group, _msg(0), Layout.DENSE, 0) == trio.group.owners, "0: never one owner"


def _inflating(reducer: ExactReducer, *, cover: bool) -> Callable[[Any], Any]:
    honest = reducer._average

    def average(slot: Any) -> Any:
        reduced, excluded, total = honest(slot)
        mean = replace(reduced.message, values=reduced.message.values * 3)
        stats = {k: [w, n * 3] for k, (w, n) in reduced.stats.items()} if cover else reduced.stats
        return _Reduced(mean, mean.to_buffers(), excluded, stats), excluded, total

    return average


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("cover", "reason"), [(False, "over the"), (True, "norm in the account")])
def test_an_only_owner_that_inflates_the_aggregate_is_banned(
    make_trio: Callable[[str], Trio], monkeypatch: pytest.MonkeyPatch, cover: bool, reason: str
) -> None:
    trio = make_trio("2" if cover else "3")
    owner = trio.nodes[0].peer_key
    monkeypatch.setattr(trio.reducers[0], "_average", _inflating(trio.reducers[0], cover=cover))
    outs = trio.reduce_all()
    for i in (1, 2):
        assert isinstance(outs[i], RoundFailed) and "inflated" in str(outs[i]), outs[i]
        bans = trio.reducers[i].bans
        assert bans.is_banned(owner)
        why = [e.reason for e in bans.events if e.peer == owner]
        assert any(reason in w for w in why), why
        assert not bans.is_banned(trio.nodes[3 - i].peer_key)


@pytest.mark.timeout(120)
def test_an_only_owner_whose_own_contribution_is_an_outlier_is_banned(
    make_trio: Callable[[str], Trio],
) -> None:
    trio = make_trio("4")
    owner = trio.nodes[0].peer_key
    outs = trio.reduce_all(scale=(1e6, 1.0, 1.0))  # what a "scale" attacker sends, counted by itself
    for i in (1, 2):
        assert isinstance(outs[i], RoundFailed), outs[i]
        why = [e.reason for e in trio.reducers[i].bans.events if e.peer == owner]
        assert any("own contribution's norm" in w for w in why), why


@pytest.mark.timeout(120)
@pytest.mark.parametrize("owners", [1, 3])
def test_a_long_honest_part_is_clipped_as_simulated_not_banned(
    node_trio: Callable[[], list[SwarmNode]], owners: int
) -> None:
    """Honest norms are heavy-tailed: a part 30 times the others' (over ``max_norm_ratio`` 10, under its
    square) counts scaled down to 10 times the lower median - the same bytes on every member and in the
    simulation's clipping, whether one owner or three own the parts - and nobody is banned."""
    cfg = CFG if owners == 1 else SwarmConfig(allreduce_timeout_s=2.0, single_owner_bytes=0)
    trio = Trio(node_trio(), f"clip{owners}", cfg)
    assert len(round_owners(trio.group, _msg(0), Layout.DENSE, cfg.single_owner_bytes)) == owners
    scale = (1.0, 1.0, 30.0)
    outs = trio.reduce_all(scale=scale)
    assert all(isinstance(o, CompressedMessage) for o in outs), outs
    messages = [replace(_msg(i), values=_msg(i).values * scale[i]) for i in range(3)]
    clipping = PartClipping(cfg.max_norm_ratio, cfg.single_owner_bytes, shared_seed=0)
    sim = SimulatedAggregator(num_devices=3, clipping=clipping)
    contributions = [Contribution(m, WEIGHTS[i]) for i, m in enumerate(messages)]
    want = sim.reduce(RoundKey(0, "delta"), contributions, server=lambda s: s)
    assert all(o.to_bytes() == want.to_bytes() for o in outs if isinstance(o, CompressedMessage))
    assert want.to_bytes() != weighted_mean(messages, list(WEIGHTS)).to_bytes(), "the long part was clipped"
    assert all(not r.bans.active_peers() for r in trio.reducers)
