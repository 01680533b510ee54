"""`collab demo`: a coordinator and N volunteers as real processes; the result equals the simulation."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collab.config import load_config, with_overrides
from collab.methods.simulation import simulate
from tests.conftest import CONFIGS, run_cli


@pytest.mark.timeout(300)
def test_demo_matches_simulation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = run_cli(
        "demo", "--peers", "3", "--max-steps", "30", "--json", "--workdir", str(tmp_path), timeout=280
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key in (
        "run_id",
        "peers",
        "steps",
        "final_metric",
        "state_hashes",
        "bits_per_peer",
        "wire_bytes_per_peer",
    ):
        assert key in out
    assert out["peers"] == 3 and out["steps"] == 30
    hashes = set(out["state_hashes"].values())
    assert len(out["state_hashes"]) == 3 and len(hashes) == 1

    cfg = with_overrides(
        load_config(CONFIGS / "demo.yaml"), num_devices=3, max_steps=30, swarm={"min_group_size": 3}
    )
    sim = simulate(cfg, stop_at_target=False)
    assert out["final_metric"] == pytest.approx(sim.final_metric, rel=1e-6)
    assert hashes == {sim.state_hash}, "the demo's state must equal the simulation's exactly"
    assert all(b == sim.bits_per_device for b in out["bits_per_peer"].values())
    assert all(w > 0 for w in out["wire_bytes_per_peer"].values())
    assert "all volunteers hold the same state" in res.stdout


@pytest.mark.timeout(180)
def test_a_terminated_demo_stops_every_process_it_started(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM (``kill``, ``timeout``) stops the demo like Ctrl-C: no coordinator, keeper, volunteer, DHT
    process or p2pd of it is left behind (sent once both volunteers have joined the swarm), and each
    volunteer left in order (its log ends with ``left``): told to leave itself, not its daemons killed
    under it (that made every volunteer wait out timeouts until the demo killed it)."""
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "peers",
            "demo",
            "--peers",
            "2",
            "--max-steps",
            "100000",
            "--workdir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        errs = [tmp_path / f"volunteer-{i}.err" for i in range(2)]
        deadline = time.monotonic() + 150
        while not all(p.exists() and ": peer " in p.read_text() for p in errs):  # both joined (DHT, p2pd up)
            assert demo.poll() is None and time.monotonic() < deadline, "the volunteers never joined"
            time.sleep(0.2)
        # the demo's children: each in a session of its own (the demo itself is in ours)
        sessions = {os.getsid(pid) for pid in _started_by(tmp_path)} - {os.getsid(0)}
        assert len(sessions) >= 3, sessions  # the coordinator and two volunteers, each in its own session
        demo.send_signal(signal.SIGTERM)
        _, err = demo.communicate(timeout=90)
        assert demo.returncode == 1 and "demo stopped: terminated" in err, err[-2000:]
        left = [pid for pid in _all_pids() if _sid(pid) in sessions and not _zombie(pid)]
        assert not left, f"left behind: {[_cmdline(pid) for pid in left]}"
        for i in range(2):
            last = json.loads((tmp_path / f"volunteer-{i}.jsonl").read_text().splitlines()[-1])
            assert last.get("event") == "left", (i, last)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=30)
        for sid in locals().get("sessions", set()) - {os.getsid(0)}:  # never our own session
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(sid, signal.SIGKILL)


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _zombie(pid: int) -> bool:
    """Exited, waiting for its new parent (not this test's) to reap it: nothing left running."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _started_by(workdir: Path) -> list[int]:
    """The processes whose command line names the demo's folder (its coordinator, volunteers, keeper)."""
    return [pid for pid in _all_pids() if str(workdir) in _cmdline(pid)]
