"""4 real peers (separate processes, own DHT and p2pd each) on 127.0.0.1 against the in-process simulation.

Every peer's state hash is identical after every step, every group holds all 4 peers, and the swarm's
trajectory equals the simulation's bit for bit: the exact reducer sums in the canonical (device index)
order, the same order as the simulation, in the same float64 arithmetic.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from collab.config import parse_config
from collab.methods.simulation import simulate
from collab.rng import coin
from tests.integration.swarm_harness import Swarm

STEPS = 30
METHODS: dict[str, dict[str, Any]] = {
    "extragradient": {"name": "extragradient", "gamma": 0.3},
    "masha1-randk10": {
        "name": "masha1",
        "gamma": 0.15,
        "tau": 0.8,
        "device_compressor": {"name": "randk", "ratio": 0.1},
    },
    "masha2-topk10": {
        "name": "masha2",
        "gamma": 0.15,
        "tau": 0.8,
        "device_compressor": {"name": "topk", "ratio": 0.1},
    },
    "masha2-topk10-adamw": {
        "name": "masha2",
        "gamma": 0.05,
        "tau": 0.8,
        "device_compressor": {"name": "topk", "ratio": 0.1},
        "optimizer": {
            "name": "adamw",
            "weight_decay": 0.01,
            "clip_norm": 5.0,
            "schedule": {"name": "cosine", "warmup_steps": 5},
        },
    },
}


def _config(method: dict[str, Any]) -> dict[str, Any]:
    return {
        "run_id": f"match-{method['name']}",
        "seed": 3,
        "num_devices": 4,
        "max_steps": STEPS,
        "task": {"name": "bilinear", "dim": 50},
        "method": method,
        "swarm": {"min_group_size": 4, "min_matchmaking_time_s": 0.5, "matchmaking_timeout_s": 10.0},
    }


@pytest.mark.timeout(240)
# masha1-randk10 runs in test_client_mode.py, with two of the four peers in client mode (a superset: the
# other two exchange as here), which keeps the suite's time within its budget
@pytest.mark.parametrize("name", [m for m in METHODS if m != "masha1-randk10"])
def test_swarm_matches_simulation(swarm: Swarm, name: str) -> None:
    data = _config(METHODS[name])
    path = swarm.write_config(data)
    peers = [swarm.start(path, device_index=i) for i in range(4)]
    summaries = [swarm.finish(p, timeout_s=200) for p in peers]

    per_peer = [p.steps() for p in peers]
    for step in range(1, STEPS + 1):
        hashes = {steps.get(step) for steps in per_peer}
        assert len(hashes) == 1 and None not in hashes, f"step {step}: hashes differ or missing: {hashes}"
    for p in peers:
        assert all(r["group"] == 4 for r in p.records() if "event" not in r), (
            "every group must hold all 4 peers"
        )

    sim = simulate(parse_config(data), stop_at_target=False)
    assert sim.steps == STEPS
    assert {s["hash"] for s in summaries} == {sim.state_hash}, (
        "swarm state must equal the simulation's exactly"
    )
    final = [r for r in peers[0].records() if "event" not in r][-1]
    assert final["metric"] == pytest.approx(sim.final_metric, rel=1e-6)
    sim_metric = {row[0]: row[3] for row in sim.rows}
    for r in peers[1].records():
        if "event" not in r:
            assert r["metric"] == sim_metric[r["step"]]
    # Accounting: the paper's bits match the simulation's; wire bytes are counted and kept apart.
    for s in summaries:
        assert s["bits_up"] == sim.bits_per_device
        assert s["wire_bytes_sent"] > 0 and s["wire_bytes_received"] > 0


def _lost_step(data: dict[str, Any]) -> int:
    """A step without a reference refresh: its only round is the one whose answers get lost (a lost
    refresh would fail the whole step for everyone, and the group would redo it together)."""
    method = data["method"]
    return next(k for k in range(8, STEPS) if not coin(data["seed"], k, "masha-reference", 1 - method["tau"]))


@pytest.mark.timeout(300)
def test_member_that_loses_a_committed_round_stays_exact(swarm: Swarm) -> None:
    """One member's answers are lost after the group committed with its contribution (a connection that
    broke as the results came back). It syncs, learns from its source that its contribution is in the
    state, and takes the error-feedback buffer that goes with it: from there every peer, the lossy one
    included, equals the simulation again bit for bit (without that, the swarm departs from it for good)."""
    data = _config(METHODS["masha2-topk10"])
    data["run_id"] = "match-lossy"
    lost_at = _lost_step(data)
    path = swarm.write_config(data)
    lossy = [sys.executable, "-m", "tests.integration.lossy_peer", f"{lost_at}.delta"]
    peers = [swarm.start(path, device_index=i, launcher=lossy if i == 2 else None) for i in range(4)]
    summaries = [swarm.finish(p, timeout_s=260) for p in peers]

    events = [r for r in peers[2].records() if r.get("event") == "round_failed"]
    assert events, "the lossy member must have failed a round"
    syncs = [r for r in peers[2].records() if r.get("event") == "sync"]
    assert syncs and syncs[0]["kept_residual"] is True, f"sync must keep the residual: {syncs}"
    others = [r for p in (peers[0], peers[1], peers[3]) for r in p.records() if "event" not in r]
    assert any(r["step"] == lost_at + 1 and r["group"] == 4 for r in others), (
        "the group must have committed the lost round with all 4 members"
    )

    sim = simulate(parse_config(data), stop_at_target=False)
    assert {s["hash"] for s in summaries} == {sim.state_hash}, (
        "after the lost round the swarm must still equal the simulation exactly"
    )
