"""Volunteers behind NAT: ``collab join --client-mode`` listens nowhere (its p2pd has no listen address at
all), so nobody can call it unless it dialed them first. It takes part in every round as a member that
owns no part - it sends its parts to the owners and gets the same aggregate back - and never leads a group,
collects confirmations or serves its state. Real processes on 127.0.0.1: 4 peers, 2 of them clients; every
state equals the others' and the simulation's bit for bit."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import P2P, PeerID

from collab.config import SwarmConfig, parse_config
from collab.methods.simulation import simulate
from collab.swarm.matchmaking import Group, Matchmaker
from collab.swarm.records import AliveRecord, PeerStatus
from collab.swarm.transport import SwarmNode, TransportError
from tests.integration.swarm_harness import Swarm, p2pd_pids
from tests.integration.test_swarm_matches_simulation import METHODS, STEPS, _config

CLIENTS = (1, 3)  # device indices of the client-mode volunteers


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


@pytest.mark.timeout(300)
def test_client_mode_volunteers_train_to_identical_states(swarm: Swarm) -> None:
    data = _config(METHODS["masha1-randk10"])  # not run without clients: see test_swarm_matches_simulation
    data["run_id"] = "client-mode"
    path = swarm.write_config(data)
    before = p2pd_pids()
    peers = [
        swarm.start(path, device_index=i, extra=["--client-mode"] if i in CLIENTS else []) for i in range(4)
    ]
    clients = [peers[i] for i in CLIENTS]

    # Each client's daemon listens nowhere: no host address, and told not to listen at all.
    def daemons(peer_index: int) -> set[int]:
        out = set()
        for pid in p2pd_pids() - before:
            with contextlib.suppress(OSError):  # each peer leads its own session, with its p2pd in it
                if os.getsid(pid) == peers[peer_index].proc.pid:
                    out.add(pid)
        return out

    swarm.wait_until(lambda: all(daemons(i) for i in range(4)), 60, "every peer's p2pd daemon")
    for i in range(4):
        args = [a for pid in daemons(i) for a in _cmdline(pid)]
        listens = [a for a in args if a.startswith("-hostAddrs")]
        if i in CLIENTS:
            assert not listens and "-noListenAddrs=1" in args, args
        else:
            assert listens and "-noListenAddrs=1" not in args, args

    # A peer that never connected to a client cannot reach it (what NAT does to others' calls).
    swarm.wait_until(lambda: all(p.records() for p in clients), 120, "the clients' first records")
    stranger = SwarmNode(initial_peers=[swarm.maddr])
    try:
        for c in clients:
            key = c.records()[0]["peer"]
            with pytest.raises(TransportError):
                stranger.run(stranger.call(key, "collab.join", {}, timeout_s=5.0), timeout_s=15)
    finally:
        stranger.shutdown()

    summaries = [swarm.finish(p, timeout_s=240) for p in peers]
    keys = {p.index: p.records()[0]["peer"] for p in peers}
    client_keys = sorted(keys[i] for i in CLIENTS)
    per_peer = [p.steps() for p in peers]
    for step in range(1, STEPS + 1):
        hashes = {steps.get(step) for steps in per_peer}
        assert len(hashes) == 1 and None not in hashes, f"step {step}: hashes differ or missing: {hashes}"
    for p in peers:
        rows = [r for r in p.records() if "event" not in r]
        assert rows and all(r["group"] == 4 for r in rows), "every group holds all 4 peers"
        # both clients were in every round, as members that own no part
        assert all(r["clients"] == client_keys for r in rows), [r["clients"] for r in rows]
    sim = simulate(parse_config(data), stop_at_target=False)
    assert {s["hash"] for s in summaries} == {sim.state_hash}, "the swarm must equal the simulation exactly"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("steady", [False, True], ids=["usual", "steady"])
def test_a_client_with_the_smallest_key_never_leads(steady: bool, tmp_path: Path) -> None:
    """A client whose key is the smallest of a round joins the smallest peer that listens instead of
    leading (nobody could call it), in the usual path and in the steady state (the last group's smallest
    non-client key leads); the group lists it as a client, so it owns no part."""
    cfg = SwarmConfig(min_group_size=3, min_matchmaking_time_s=0.3, matchmaking_timeout_s=6.0)
    identities = []
    for k in range(3):  # the client gets the identity whose peer key sorts first
        path = tmp_path / f"id{k}.key"
        P2P.generate_identity(str(path))
        identities.append((PeerID.from_identity(path.read_bytes()).to_base58(), str(path)))
    identities.sort()
    first = SwarmNode(identity_path=identities[1][1])
    nodes = [first]
    try:
        nodes.append(SwarmNode(initial_peers=first.visible_maddrs(), identity_path=identities[2][1]))
        client = SwarmNode(
            initial_peers=first.visible_maddrs(), client_mode=True, identity_path=identities[0][1]
        )
        nodes.append(client)
        assert client.peer_key < min(n.peer_key for n in nodes[:2])
        makers = [
            Matchmaker(node=n, run_id="clients", cfg=cfg, device_index=i, config_version="v")
            for i, n in enumerate(nodes)
        ]
        view = {n.peer_key: AliveRecord(step=2, status=PeerStatus.TRAINING) for n in nodes}
        for mm in makers:
            mm.alive_peers = dict(view)
        if steady:  # as after a committed round of these three
            for mm in makers:
                mm.remember_group([n.peer_key for n in nodes], [client.peer_key])

        async def gather() -> list[Group]:
            futures = [
                asyncio.wrap_future(asyncio.run_coroutine_threadsafe(mm.form_group("2.delta"), n._loop))
                for mm, n in zip(makers, nodes, strict=True)
            ]
            return list(await asyncio.gather(*futures))

        groups = first.run(gather(), timeout_s=60)
        assert len({g.group_id for g in groups}) == 1, groups
        group = groups[0]
        assert sorted(group.peers) == sorted(n.peer_key for n in nodes)
        assert group.clients == (client.peer_key,)
        assert group.owners == [p for p in group.peers if p != client.peer_key]  # canonical order
        leader = min(n.peer_key for n in nodes[:2])
        assert makers[[n.peer_key for n in nodes].index(leader)]._rounds["2.delta"].role == "leader"
    finally:
        for n in reversed(nodes):
            n.shutdown()


@pytest.mark.timeout(450)
def test_a_late_client_downloads_the_state_and_joins_the_rounds(swarm: Swarm) -> None:
    """A client that starts after the others have moved ahead takes their state by download (it dials
    them) and then takes part in their rounds with the same state as everyone. The run is open-ended and
    the test watches the client's progress: on a busy machine the listeners may run hundreds of steps
    before the client is up (a fixed step budget once let them finish first)."""
    data = _config(METHODS["masha2-topk10"])
    data["run_id"] = "client-late"
    data["swarm"]["min_group_size"] = 3
    data["max_steps"] = 100_000  # stopped by the test once the client has trained along
    path = swarm.write_config(data)
    servers = [swarm.start(path, device_index=i) for i in range(3)]
    swarm.wait_until(lambda: all(p.last_step() >= 5 for p in servers), 150, "the listeners at step 5")
    late = swarm.start(path, device_index=3, extra=["--client-mode"])

    def rounds() -> list[dict[str, Any]]:
        return [r for r in late.records() if "event" not in r]

    swarm.wait_until(lambda: len(rounds()) >= 10, 240, "10 rounds of the late client")
    for p in [*servers, late]:
        swarm.kill(p)
    records = late.records()
    syncs = [r for r in records if r.get("event") == "sync"]
    assert syncs and syncs[0]["step"] >= 5, f"the late client must download a state: {syncs}"
    key = records[0]["peer"]
    mine = rounds()
    assert all(r["clients"] == [key] and r["group"] == 4 for r in mine), mine[:3]
    # every step the client committed, the listeners committed with the same state
    # (a listener killed a moment before it wrote the step's line: only its last steps may be missing)
    logs = [p.steps() for p in servers]
    checked = [r for r in mine if all(r["step"] in log for log in logs)]
    assert len(checked) >= len(mine) - 2, (len(checked), len(mine))
    for r in checked:
        assert all(log[r["step"]] == r["hash"] for log in logs), (r, [log[r["step"]] for log in logs])
