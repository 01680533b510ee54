"""`collab join --resume`: a volunteer restarts from its local checkpoint, on real peers.

Every case trains with Adam, whose moments are part of the replicated state (and of the checkpoint).

* A lone peer runs 10 steps and exits (--resume with no checkpoint yet: it says so and starts fresh);
  restarted with --resume it goes on from step 11, and its steps are bit-identical to an uninterrupted
  20-step run (a checkpoint loses nothing).
* A peer SIGKILLed mid-run (no exit handler) resumes from its last periodic checkpoint (--checkpoint-every)
  and redoes the lost steps bit for bit.
* A checkpoint with one flipped byte is reported in one line and not loaded: the peer starts fresh.
* A checkpoint behind the swarm is loaded, then the swarm's newer state wins (hash-checked sync) and
  the resumed peer trains in step with the others until the test stops them (SIGTERM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.swarm_harness import Peer, Swarm

LONE = {
    "run_id": "resume",
    "seed": 3,
    "num_devices": 2,
    "max_steps": 1000,
    "task": {"name": "bilinear", "dim": 50, "reg_lambda": 0.5},
    "method": {
        "name": "masha1",
        "gamma": 0.2,
        "tau": 0.7,
        "device_compressor": {"name": "randk", "ratio": 0.25},
        # Adam's moments are replicated state: a resumed peer must carry them bit for bit.
        "optimizer": {"name": "adam", "schedule": {"name": "cosine", "warmup_steps": 3}},
    },
    "swarm": {
        "min_group_size": 1,  # a peer on its own makes progress
        "min_matchmaking_time_s": 0.2,
        "matchmaking_timeout_s": 3.0,
        "allreduce_timeout_s": 3.0,
        "heartbeat_interval_s": 0.5,
        "heartbeat_ttl_s": 2.0,
    },
}


def _config(swarm: Swarm, name: str, data: dict[str, Any]) -> Path:
    path = swarm.tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _start(swarm: Swarm, config: Path, device_index: int, *extra: str) -> Peer:
    """``Swarm.start`` (reaped by the fixture like its peers) with extra `collab join` flags."""
    return swarm.start(config, device_index, extra=["--linger", "1", "--no-progress", *extra])


def _step_lines(peer: Peer) -> list[int]:
    return [r["step"] for r in peer.records() if "event" not in r]


def _events(peer: Peer, name: str) -> list[dict[str, Any]]:
    return [r for r in peer.records() if r.get("event") == name]


def _said(peer: Peer, prefix: str) -> list[str]:
    """The lines `collab join` printed on stderr starting with ``prefix`` (not log lines)."""
    return [line for line in peer.err.read_text().splitlines() if line.startswith(prefix)]


@pytest.mark.timeout(120)
def test_lone_peer_resumes_where_it_stopped(swarm: Swarm) -> None:
    config = _config(swarm, "run", LONE)
    ckpt = swarm.tmp / "volunteer.ckpt"
    # the reference: 20 steps without a break, in a run of its own (another run_id: another DHT key space)
    reference = _start(swarm, _config(swarm, "ref", {**LONE, "run_id": "resume-ref"}), 0, "--max-steps", "20")
    first = _start(swarm, config, 0, "--checkpoint", str(ckpt), "--resume", "--max-steps", "10")
    assert swarm.finish(first, timeout_s=90)["step"] == 10
    assert _said(first, "checkpoint ") == [f"checkpoint {ckpt} does not exist yet: starting fresh"]
    assert ckpt.stat().st_size > 0, "the checkpoint is written on exit"

    resumed = _start(swarm, config, 0, "--checkpoint", str(ckpt), "--resume", "--max-steps", "20")
    summary = swarm.finish(resumed, timeout_s=90)
    ref_summary = swarm.finish(reference, timeout_s=90)

    assert _said(resumed, "resumed from checkpoint") == [f"resumed from checkpoint {ckpt} at step 10"]
    loaded = _events(resumed, "resumed")
    assert len(loaded) == 1 and loaded[0]["step"] == 10 and loaded[0]["hash"] == first.steps()[10]
    assert not _events(resumed, "initialized") and not _events(resumed, "sync")
    assert _step_lines(resumed) == list(range(11, 21)), "it goes on from step 11, nothing redone or skipped"
    for step in range(11, 21):
        assert resumed.steps()[step] == reference.steps()[step], f"step {step} differs from an unbroken run"
    assert summary["step"] == 20 and summary["hash"] == ref_summary["hash"]


@pytest.mark.timeout(120)
def test_killed_peer_resumes_from_its_last_periodic_checkpoint(swarm: Swarm) -> None:
    config = _config(swarm, "run", LONE)
    ckpt = swarm.tmp / "volunteer.ckpt"
    first = _start(swarm, config, 0, "--checkpoint", str(ckpt), "--checkpoint-every", "10")
    swarm.wait_until(lambda: first.last_step() >= 25, 90, "the peer to pass step 25")
    swarm.kill(first)  # SIGKILL: no exit handler runs; only the periodic checkpoint is left
    killed_at = first.last_step()

    resumed = _start(
        swarm, config, 0, "--checkpoint", str(ckpt), "--resume", "--max-steps", str(killed_at + 5)
    )
    swarm.finish(resumed, timeout_s=90)
    loaded = _events(resumed, "resumed")
    assert len(loaded) == 1, resumed.err.read_text()[-2000:]
    at = loaded[0]["step"]
    assert at % 10 == 0 and killed_at - 10 < at <= killed_at, f"checkpoint at {at}, killed at {killed_at}"
    assert loaded[0]["hash"] == first.steps()[at]
    assert _step_lines(resumed) == list(range(at + 1, killed_at + 6))
    for step in range(at + 1, killed_at + 1):  # the redone steps are the same steps
        assert resumed.steps()[step] == first.steps()[step]


@pytest.mark.timeout(120)
def test_corrupt_checkpoint_is_reported_and_not_loaded(swarm: Swarm) -> None:
    config = _config(swarm, "run", LONE)
    ckpt = swarm.tmp / "volunteer.ckpt"
    first = _start(swarm, config, 0, "--checkpoint", str(ckpt), "--max-steps", "5")
    swarm.finish(first, timeout_s=90)
    data = bytearray(ckpt.read_bytes())
    data[-20] ^= 0x01  # one bit of one float of the state
    ckpt.write_bytes(bytes(data))

    again = _start(swarm, config, 0, "--checkpoint", str(ckpt), "--resume", "--max-steps", "8")
    summary = swarm.finish(again, timeout_s=90)
    assert _said(again, "checkpoint ") == [f"checkpoint {ckpt} is corrupt (hash mismatch); not loaded"]
    assert "Traceback" not in again.err.read_text()
    assert not _events(again, "resumed") and _events(again, "initialized"), "it starts as a fresh peer"
    assert _step_lines(again) == list(range(1, 9))
    for step in range(1, 6):
        assert again.steps()[step] == first.steps()[step], "a fresh start repeats the same steps"
    assert summary["step"] == 8
    # on exit the damaged file was replaced by a good checkpoint of the new run
    third = _start(swarm, config, 0, "--checkpoint", str(ckpt), "--resume", "--max-steps", "8")
    swarm.finish(third, timeout_s=90)
    assert _said(third, "resumed from checkpoint") == [f"resumed from checkpoint {ckpt} at step 8"]


SWARM = {
    **LONE,
    "run_id": "resume-swarm",
    "num_devices": 3,
    "max_steps": 100_000,  # the test stops the run once the resumed peer has trained with the others
    "swarm": {**LONE["swarm"], "min_group_size": 2, "min_matchmaking_time_s": 0.3},
}
RESUMED_ROUNDS = 5  # rounds the resumed peer takes part in before the test stops the run


@pytest.mark.timeout(180)
def test_resume_behind_the_swarm_syncs_to_it(swarm: Swarm) -> None:
    config = _config(swarm, "swarm", SWARM)
    ckpt = swarm.tmp / "volunteer.ckpt"
    # the leaver trains steps 1-5 with one steady peer (min_group_size 2: neither moves without the other,
    # so the leaver cannot start late and skip them); the second steady peer comes after
    first = _start(swarm, config, 0)
    leaver = _start(swarm, config, 2, "--checkpoint", str(ckpt), "--max-steps", "5")
    swarm.finish(leaver, timeout_s=90)
    steady = [first, _start(swarm, config, 1)]
    swarm.wait_until(lambda: min(p.last_step() for p in steady) >= 15, 90, "the swarm to reach step 15")

    resumed = _start(swarm, config, 2, "--checkpoint", str(ckpt), "--resume")
    swarm.wait_until(lambda: len(resumed.steps()) >= RESUMED_ROUNDS, 90, "the resumed peer to train")
    summaries = swarm.stop([*steady, resumed], timeout_s=60)

    loaded = _events(resumed, "resumed")
    assert len(loaded) == 1 and loaded[0]["step"] == 5 and loaded[0]["hash"] == leaver.steps()[5]
    syncs = _events(resumed, "sync")
    assert syncs and syncs[0]["step"] >= 15, "the swarm is ahead of the checkpoint: its state wins"
    own = resumed.steps()
    assert own and min(own) > syncs[0]["step"], "no step is trained from the old checkpoint"
    # SIGTERM reaches the peers one by one: the last round may have gone on without one steady peer
    # (min_group_size 2), so each step is checked against whichever steady peer took it
    swarm_steps: dict[int, str] = {}
    for p in steady:
        for step, h in p.steps().items():
            assert swarm_steps.setdefault(step, h) == h, f"the steady peers differ at step {step}"
    for step, h in own.items():
        assert h == swarm_steps[step], f"the resumed peer differs from the swarm at step {step}"
    logged = {step: h for p in [*steady, resumed] for step, h in p.steps().items()}
    assert all(s["hash"] == logged[s["step"]] for s in summaries), summaries
