"""Faults on real peers: a peer SIGKILLed in the middle of a round, and a new peer joining mid-run.

4 peers start; the one with device 3 kills its whole process group (peer, DHT, p2pd) in the middle of
its first delta round (after its parts are on the wire, before the answers): round 0.delta when the
four come up together, a later one when it starts late and syncs first. The survivors must redo that step
without it and keep identical states. Four steps later a fifth peer starts on device 3's shard: it downloads
the state (Adam's moments included) from a peer ahead, checks the hash, and from its first round on its
state hash equals the others'. Once it has taken part in ``NEW_ROUNDS`` rounds the test stops everyone
(SIGTERM: each leaves after its current round, exit 0) - the run is as long as the checks need, whatever
the machine's pace - and by then the run's distance to the solution has at least halved.
"""

from __future__ import annotations

import re
import sys

import pytest

from collab.config import parse_config
from collab.methods.simulation import simulate
from tests.integration.swarm_harness import Swarm

KILL_ROUND = "first.delta"  # the victim's first round of that phase, whatever step the run is at
NEW_ROUNDS = 20  # rounds the newcomer takes part in before the test stops the run

CONFIG = {
    "run_id": "faults",
    "seed": 5,
    "num_devices": 4,
    "max_steps": 100_000,  # stopped by the test
    "task": {"name": "bilinear", "dim": 50, "reg_lambda": 0.5},
    "method": {
        "name": "masha1",
        "gamma": 0.03,
        "tau": 0.7,
        "device_compressor": {"name": "randk", "ratio": 0.25},
        # Adam's moments are replicated state: the late joiner must download them with the rest.
        "optimizer": {"name": "adam"},
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


@pytest.mark.timeout(300)
def test_kill_mid_round_and_late_joiner(swarm: Swarm) -> None:
    path = swarm.write_config(CONFIG)
    dying = [sys.executable, "-m", "tests.integration.dying_peer", KILL_ROUND]
    peers = [swarm.start(path, i, launcher=dying if i == 3 else None) for i in range(4)]
    victim, survivors = peers[3], peers[:3]

    swarm.wait_until(lambda: victim.proc.poll() is not None, 120, "the victim to die in its first round")
    assert victim.proc.returncode == -9, "the victim must have been SIGKILLed by the fault hook"
    died = re.search(r"in the middle of round (\d+)\.delta", victim.err.read_text())
    assert died, victim.err.read_text()[-2000:]
    k = int(died[1])  # it died in round k.delta, holding the state of step k (trained to or synced)
    assert [r["step"] for r in victim.records() if r.get("event") != "round_failed"][-1:] == [k]

    swarm.wait_until(
        lambda: min(p.last_step() for p in survivors) >= k + 4, 120, f"survivors at step {k + 4}"
    )
    newcomer = swarm.start(path, 3)
    swarm.wait_until(
        lambda: len(newcomer.steps()) >= NEW_ROUNDS, 180, f"{NEW_ROUNDS} rounds with the newcomer"
    )
    everyone = [*survivors, newcomer]
    together = min(p.last_step() for p in everyone)  # every round up to here had all four
    summaries = swarm.stop(everyone, timeout_s=60)
    last = min(s["step"] for s in summaries)

    # Survivors: every step exactly once, in order, identical hashes at every step. On a loaded machine a
    # survivor may start after the others trained a few steps (min_group_size 2): it then catches up by
    # one hash-checked download before its first step, like a joiner, and never needs one afterwards.
    for p in survivors:
        records = p.records()
        steps = [r["step"] for r in records if "event" not in r]
        assert steps and steps == list(range(steps[0], steps[-1] + 1)), (
            f"peer {p.index}: steps skipped or repeated"
        )
        first_step = next(i for i, r in enumerate(records) if "event" not in r)
        late = [r for r in records[first_step:] if r.get("event") == "sync"]
        assert not late, f"peer {p.index} needed a resync after it started training: {late}"
        assert steps[0] == 1 or any(r.get("event") == "sync" for r in records[:first_step])
    on_time = [p for p in survivors if min(p.steps()) == 1]
    assert on_time, "at least one survivor trained from the start"
    for step in range(1, last + 1):
        assert len({p.steps()[step] for p in survivors if step in p.steps()}) == 1, (
            f"survivors differ at {step}"
        )

    # Step k + 1 was committed without the victim: the round it broke was redone by the survivors then
    # training (on a loaded machine one may start so late that it syncs past k + 1).
    training = [p for p in survivors if any(r["step"] == k for r in p.records())]
    failed = [r for p in training for r in p.records() if r.get("event") == "round_failed" and r["step"] == k]
    assert failed, f"the killed peer's round {k}.delta must have failed for the survivors"
    present = [p for p in survivors if k + 1 in p.steps()]
    assert len(present) >= 2
    for p in present:
        assert {r["group"] for r in p.records() if r.get("step") == k + 1 and "event" not in r} == {
            len(present)
        }

    # The newcomer synced (hash-checked) and matches the others from its first round on.
    syncs = [r for r in newcomer.records() if r.get("event") == "sync"]
    assert syncs, "the newcomer must download the state"
    new_steps = newcomer.steps()
    assert new_steps, "the newcomer must take part in rounds"
    first = min(new_steps)
    assert first > k + 1
    known = {step: h for p in survivors for step, h in p.steps().items()}  # equal where they overlap
    for step, h in new_steps.items():  # every round of the newcomer's had a survivor (min_group_size 2)
        assert h == known.get(step), f"newcomer differs at step {step}"
    assert all(r["group"] == 4 for r in newcomer.records() if "event" not in r and r["step"] <= together)

    # Everyone left after its current round, with the state every log has for that step.
    logged = {step: h for p in everyone for step, h in p.steps().items()}
    assert all(s["hash"] == logged[s["step"]] for s in summaries), summaries
    # The run goes on converging. Steps k + 1 until the newcomer came ran in groups of 3 of the 4 different
    # shards, which pull towards another problem's solution: on a quiet machine the newcomer came at step
    # ~100 and the run stood at 1.2x the fault-free simulation's distance; under load at step 167, 2x.
    # How many such steps there are depends on the machine, so the check is on progress, not the ratio.
    sim = {
        r[0]: r[3] for r in simulate(parse_config({**CONFIG, "max_steps": last}), stop_at_target=False).rows
    }
    metric = {r["step"]: r["metric"] for r in survivors[0].records() if "event" not in r}
    start, final = metric[min(metric)], metric[last]
    print(
        f"\nfaults: victim died in {k}.delta, newcomer from step {first}, stopped at {last}: "
        f"{final:.3f}, fault-free {sim[last]:.3f}"
    )
    assert final <= 0.5 * start, f"relative distance {start} at step {min(metric)}, still {final} at {last}"
