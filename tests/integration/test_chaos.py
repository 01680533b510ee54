"""Chaos on real peers: 5 volunteers, one SIGKILLed (whole process group) about every 10 s and restarted.

Five `collab join` processes train one shard each (num_devices = 5). While the run lasts (~60 s), a victim
drawn by ``random.Random(SEED)`` is killed with SIGKILL to its process group (peer, DHT process, p2pd: a
machine going down), at whatever point of whatever round it is in, and a fresh `collab join` on the same
shard is started at once: it downloads the state from a peer that is ahead (hash checked) and takes part
again. A kill comes 10 s after the previous one or when the leading peer passes the next of
``KILL_MARKS``, whichever is first, and only once the previous victim's successor takes part again: one
outage at a time, never so late that the run could end before the successor is back (judged by how many
steps the earlier restarts took), up to 5 (a restart takes 2-20 s on 2 cores, depending on the load;
rounds take tens of milliseconds, so on a busy machine the run may end after 2 or 3 - at least 2 are
required, or 1 where a restart took over a third of the run's steps: then there is room for no second).

What is asserted does not depend on timing:

* the run finishes: every live peer takes part again after its restart and exits 0 at ``STEPS``, and all
  of them hold the same state hash;
* nobody applies a step twice or skips one: in every peer's log (killed ones included) the per-step
  lines go up by exactly one, except right after a ``sync`` event, from whose step they then continue;
* nobody diverges or starts over: for every step, the post-step hash is the same in every log that has
  it (per-step lines, ``initialized`` and the states adopted by ``sync``); no successor initializes;
* the final relative distance is within 2x of the fault-free run's - when at most half of the steps ran
  in partial groups; on a machine so busy that restarts outlast most of the run, it must still have
  fallen 3 decades from the first step.

The fault-free baseline is the in-process simulation: with every shard in every group the swarm is
bit-identical to it (test_swarm_matches_simulation.py), which this test checks again on the steps before
the first partial group (there may be none: a peer that starts late makes the first rounds partial too).
With faults, the steps of an outage average 4 (or 3) of the 5 heterogeneous shards and pull the iterate
towards another problem's solution: with the demo's ``init_scale`` of 1 that pull sits at ~5e-3 relative
distance, orders of magnitude above any converged run, so faults would dominate any comparison. Here the
run starts 50x farther out (the pull shrinks 2500x relative to the start) and stops at 6.9e-5 (4 decades
of progress, far above the float32 floor). Measured in process with this schedule and these victims
(restarts of T +- 30%, 4 draws): at 5 steps/s, T = 7 s costs 0.97-0.98x, T = 12 s 1.03-1.09x, T = 20 s
1.38-1.62x; at 3 steps/s and T = 20 s 0.81-0.89x; at 7 steps/s and T = 12 s 1.22-1.27x. A shard that
never came back from step 40 on would cost 1.8x (and fails the take-part check first), two 3.1x.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from collab.config import parse_config
from collab.methods.simulation import simulate
from tests.integration.swarm_harness import Peer, Swarm

SEED = 0  # victims: shards 3, 3, 0, 2, 4
PEERS = 5
STEPS = 300  # ~60 s at the ~5 steps/s of 5 peers on 2 cores
KILL_MARKS = [40, 80, 120, 160, 200]
KILL_EVERY_S = 10.0
CATCH_UP_S = 60.0
MIN_RESTART_STEPS = 30  # steps the run is assumed to go on while a successor starts, until one is seen

CONFIG: dict[str, Any] = {
    "run_id": "chaos",
    "seed": 5,
    "num_devices": PEERS,
    "max_steps": STEPS,
    "task": {"name": "bilinear", "dim": 50, "reg_lambda": 0.5, "heterogeneity": 1.0, "init_scale": 50.0},
    "method": {
        "name": "masha1",
        "gamma": 0.05,
        "tau": 0.7,
        "device_compressor": {"name": "randk", "ratio": 0.25},
    },
    "swarm": {
        "min_group_size": 2,
        "min_matchmaking_time_s": 0.5,
        "matchmaking_timeout_s": 6.0,
        "allreduce_timeout_s": 3.0,
        "heartbeat_interval_s": 0.5,
        "heartbeat_ttl_s": 2.0,
    },
}


def check_history(peer: Peer, hashes: dict[int, dict[str, set[int]]]) -> None:
    """One log: steps go up by one (a ``sync`` jumps ahead), every event is at the current step.

    Collects ``step -> hash -> {peer index}`` from the per-step lines, ``initialized`` and ``sync``."""
    current: int | None = None  # no state yet
    for r in peer.records():
        event, step = r.get("event"), r["step"]
        if event == "initialized":
            assert current is None and step == 0, f"peer {peer.index}: initialized at {step} after {current}"
        elif event == "sync":
            assert current is None or step > current, f"peer {peer.index}: synced to {step} from {current}"
        elif event == "round_failed":
            assert step == (-1 if current is None else current), f"peer {peer.index}: {r} at {current}"
            continue
        elif event is None:
            assert current is not None and step == current + 1, (
                f"peer {peer.index}: step {step} after step {current} (applied twice or skipped)"
            )
        else:
            continue
        current = step
        hashes.setdefault(step, {}).setdefault(r["hash"], set()).add(peer.index)


@pytest.mark.slow
# a hang guard only: every wait inside is derived from the peers' progress (2-5 steps/s on 2 cores)
@pytest.mark.timeout(420)
def test_chaos_kill_and_restart(swarm: Swarm) -> None:
    path = swarm.write_config(CONFIG)
    rng = random.Random(SEED)
    live = {shard: swarm.start(path, shard) for shard in range(PEERS)}  # shard -> its current process

    def leader() -> int:
        return max(p.last_step() for p in live.values())

    swarm.wait_until(lambda: leader() >= 1, 60, "the first step")
    t0 = last_kill = time.monotonic()
    killed: list[tuple[int, int, float]] = []  # (shard, leader's step, seconds since the first step)

    def back(p: Peer) -> bool:
        """Took part in a round again (or, started so late that the others finished, took the end state)."""
        return bool(p.steps()) or any(r.get("event") == "sync" and r["step"] >= STEPS for r in p.records())

    successor: Peer | None = None
    restart_steps: list[int] = []  # how far the run went while each successor came back (leader's steps)
    for mark in KILL_MARKS:
        swarm.wait_until(
            lambda m=mark, t=last_kill: leader() >= m or time.monotonic() - t >= KILL_EVERY_S,
            60,
            f"step {mark}",
        )
        # one outage at a time: the previous successor takes part again before the next kill (rounds
        # are fast; on a busy machine a restart can outlast a whole stretch between marks)
        if successor is not None:
            swarm.wait_until(
                lambda p=successor: back(p) or leader() >= STEPS, CATCH_UP_S, "the successor to take part"
            )
            restart_steps.append(leader() - killed[-1][1])
        # no kill that the run could end before its successor is back: the others would have left, and
        # it would find nobody to sync from (seen under load: restarts took 90-110 steps of the run, the
        # last victim died at step 247 of 300 and its successor came up after the others had left)
        if leader() + max([MIN_RESTART_STEPS, *restart_steps]) >= STEPS:
            break
        shard = rng.randrange(PEERS)
        killed.append((shard, leader(), round(time.monotonic() - t0, 1)))
        swarm.kill(live[shard])
        assert live[shard].proc.returncode == -9
        last_kill = time.monotonic()
        live[shard] = successor = swarm.start(path, shard)
    restarted = [p for p in swarm.peers if p.index >= PEERS]

    # two outages at least - unless a restart took over a third of the run (seen with both cores busy: a
    # successor needed 22 s, 150 of the 300 steps, to come back), when the run has room for one only
    slow_restarts = any(3 * steps > STEPS for steps in restart_steps)
    assert len(killed) >= (1 if slow_restarts else 2), (
        f"too few kills before the end: {killed}, {restart_steps}"
    )
    # Every successor still alive downloads the state and takes part in rounds again (or, started so late
    # that the others finished meanwhile, downloads the final state).
    swarm.wait_until(lambda: all(back(p) for p in live.values()), CATCH_UP_S, "the successors to catch up")
    summaries = [swarm.finish(p, timeout_s=120) for p in live.values()]
    elapsed = time.monotonic() - t0

    # The run finished: every live peer reached STEPS, with the same state.
    assert {s["step"] for s in summaries} == {STEPS}
    assert len({s["hash"] for s in summaries}) == 1, f"final states differ: {summaries}"

    # No step applied twice or skipped in any history; no two peers disagree on any step.
    hashes: dict[int, dict[str, set[int]]] = {}
    for p in swarm.peers:
        check_history(p, hashes)
    diverged = {step: seen for step, seen in hashes.items() if len(seen) > 1}
    assert not diverged, f"peers disagree on the state after these steps: {diverged}"
    assert set(hashes) >= set(range(STEPS + 1)), "every step was committed by someone"
    survivors = {p.index for p in live.values()}
    for p in restarted:
        events = {r.get("event") for r in p.records()}
        assert "initialized" not in events, f"peer {p.index} started over instead of syncing"
        assert "sync" in events or p.index not in survivors, f"peer {p.index} never synced"

    # The fault-free baseline: the simulation, which the swarm equals while every shard takes part.
    sim = simulate(parse_config(CONFIG), stop_at_target=False)
    sim_metric = {row[0]: row[3] for row in sim.rows}
    lines = [r for p in swarm.peers for r in p.records() if "event" not in r]
    partial = sorted({r["step"] for r in lines if r["group"] < PEERS})
    inits = [r for p in swarm.peers for r in p.records() if r.get("event") == "initialized"]
    if len(inits) < PEERS:  # a late starter missed the initial round (F(w^0) of fewer shards) and synced
        partial.insert(0, 0)
    clean = partial[0] - 1 if partial else STEPS
    for r in lines:
        if r["step"] <= clean:
            assert r["metric"] == sim_metric[r["step"]], f"step {r['step']}: the swarm left the simulation"
    final = next(r["metric"] for r in lines if r["step"] == STEPS)
    ratio = final / sim.final_metric
    print(
        f"\nchaos: {elapsed:.0f}s from the first step; kills (shard, step, s): {killed}; "
        f"{len(partial)} steps in groups of < {PEERS}; equal to the simulation up to step {clean}; "
        f"final metric {final:.3e}, fault-free {sim.final_metric:.3e} (x{ratio:.2f})"
    )
    if len(partial) <= STEPS // 2:
        assert 0.5 <= ratio <= 2.0, f"final metric {final:.3e} vs fault-free {sim.final_metric:.3e}"
    else:  # restarts outlasted most of the run (a busy machine): it must still have converged
        first = next(r["metric"] for r in lines if r["step"] == 1)
        assert final <= 1e-3 * first, f"final metric {final:.3e} after {len(partial)} partial steps"
