"""The roles as separate commands, the way the README tells people to run them."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import CONFIGS, run_cli
from tests.e2e.roles import Roles


def _config(tmp: Path, **changes: object) -> Path:
    data = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    data.update(changes)
    path = tmp / f"run-{len(list(tmp.glob('run-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _hivemind_dht() -> str:
    """hivemind's own DHT command, installed beside this interpreter."""
    beside = Path(sys.executable).parent / "hivemind-dht"
    return str(beside) if beside.exists() else "hivemind-dht"


def _last_step(log: Path) -> int:
    if not log.exists():
        return -1
    steps = [
        json.loads(line).get("step", -1) for line in log.read_text().splitlines() if '"event"' not in line
    ]
    return max(steps, default=-1)


@pytest.mark.timeout(300)
def test_coordinator_volunteers_kill_and_late_join(roles: Roles, tmp_path: Path) -> None:
    # the run is as long as the test needs: it ends (SIGTERM, as a volunteer's Ctrl-C) once the late
    # volunteer has trained with the others until the run converged again
    cfg = _config(tmp_path, max_steps=100_000, num_devices=3)
    coord = roles.start("coordinator", "--config", str(cfg), "--port", "0", name="coordinator")
    url = roles.read_line(coord, "config server: ")
    join_cmd = roles.read_line(coord, "volunteers join with: ")
    assert join_cmd == f"collab join --coordinator {url}"
    with urllib.request.urlopen(url + "/healthz", timeout=10) as resp:
        assert json.loads(resp.read())["status"] == "ok"

    logs = [tmp_path / f"v{i}.jsonl" for i in range(4)]

    def volunteer(i: int, shard: int) -> subprocess.Popen[str]:
        args = ["--device-index", str(shard), "--name", f"v{i}", "--log-file", str(logs[i]), "--json"]
        return roles.start(
            "join", "--coordinator", url, *args, "--checkpoint", str(tmp_path / f"v{i}.state"), name=f"v{i}"
        )

    def records(i: int) -> list[dict[str, Any]]:
        return [json.loads(x) for x in logs[i].read_text().splitlines()] if logs[i].exists() else []

    def converged_with_late() -> bool:
        # 1e-3 is ~60 steps of all three shards; the steps in a group of two before pull it away
        trained = [r for r in records(3) if "event" not in r]
        return len(trained) >= 10 and trained[-1]["metric"] < 1e-3

    vols = [volunteer(i, i) for i in range(3)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and min(_last_step(log) for log in logs[:3]) < 20:
        time.sleep(0.2)
    roles.kill(vols[2])  # a volunteer's machine goes away
    late = volunteer(3, 2)  # another one joins mid-run and takes over the lost shard
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not converged_with_late():
        assert late.poll() is None, (tmp_path / "v3.err").read_text()[-2000:]
        time.sleep(0.2)
    assert converged_with_late(), [r for r in records(3) if "event" not in r][-1:]
    staying = [(0, vols[0]), (1, vols[1]), (3, late)]
    for _, p in staying:
        p.send_signal(signal.SIGTERM)
    summaries = [roles.summary(p, 60, f"v{i}") for i, p in staying]
    logged = {r["step"]: r["hash"] for i, _ in staying for r in records(i) if "event" not in r}
    assert all(s["hash"] == logged[s["step"]] for s in summaries), "the volunteers still in the run agree"
    late_log = records(3)
    assert any(r.get("event") == "sync" for r in late_log), "the late volunteer downloads the state"
    for i in (0, 1, 3):
        assert (tmp_path / f"v{i}.state").stat().st_size > 0, "checkpoint written on exit"
    roles.kill(coord, signal.SIGTERM)
    assert coord.returncode == 0, (tmp_path / "coordinator.err").read_text()[-2000:]


@pytest.mark.timeout(120)
def test_coordinator_restart_serves_same_config_and_identity(roles: Roles, tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    ident = tmp_path / "coordinator.key"
    seen = []
    for attempt in range(2):
        coord = roles.start(
            "coordinator",
            "--config",
            str(cfg),
            "--port",
            "0",
            "--identity",
            str(ident),
            name=f"coord{attempt}",
        )
        url = roles.read_line(coord, "config server: ")
        with urllib.request.urlopen(url + "/v1/run", timeout=10) as resp:
            run = json.loads(resp.read())
        seen.append((run["version"], re.sub(r"^.*/p2p/", "", run["initial_peers"][0]), run["config"]))
        roles.kill(coord, signal.SIGTERM)
    assert seen[0] == seen[1], "same config version, same DHT identity, same config after a restart"


def test_bad_config_starts_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: {name: masha2, gamma: 0.1, device_compressor: {name: randk}}\nmax_steps: 0\n")
    res = run_cli("coordinator", "--config", str(bad), "--port", "0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert (
        len(lines) == 2
        and any("max_steps" in line for line in lines)
        and any("method" in line for line in lines)
    )
    assert "config server" not in res.stdout


def test_join_unreachable_coordinator_is_one_line() -> None:
    res = run_cli("join", "--coordinator", "http://127.0.0.1:9", "--no-progress", timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().count("\n") == 0 and "cannot reach the coordinator" in res.stderr


@pytest.mark.timeout(180)
def test_volunteers_join_a_plain_hivemind_dht(roles: Roles, tmp_path: Path) -> None:
    """A DHT started by hivemind's own `hivemind-dht` command, not by collab."""
    dht = subprocess.Popen(
        [
            "hivemind-dht",
            "--host_maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--identity_path",
            str(tmp_path / "dht.key"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    roles.procs.append(dht)
    maddr = None
    deadline = time.monotonic() + 60
    assert dht.stdout is not None
    while maddr is None and time.monotonic() < deadline:
        line = dht.stdout.readline()
        found = re.search(r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", line)
        if found:
            maddr = found.group(1)
    assert maddr, "hivemind-dht did not print its address"
    cfg = _config(tmp_path, max_steps=40, num_devices=2)
    vols = [
        roles.start(
            "join",
            "--config",
            str(cfg),
            "--initial-peers",
            maddr,
            "--device-index",
            str(i),
            "--json",
            name=f"h{i}",
        )
        for i in range(2)
    ]
    summaries = [roles.summary(p, 150, f"h{i}") for i, p in enumerate(vols)]
    assert {s["step"] for s in summaries} == {40} and len({s["hash"] for s in summaries}) == 1


@pytest.mark.timeout(180)
def test_volunteer_refuses_a_different_config(roles: Roles, tmp_path: Path) -> None:
    good, other = _config(tmp_path, max_steps=300), _config(tmp_path, max_steps=300, seed=99)
    coord = roles.start("coordinator", "--config", str(good), "--port", "0", name="coordinator")
    roles.read_line(coord, "config server: ")
    maddr = roles.read_line(coord, "DHT: ").split()[0]
    first = roles.start(
        "join", "--config", str(good), "--initial-peers", maddr, "--device-index", "0", name="ok0"
    )
    second = roles.start(
        "join", "--config", str(good), "--initial-peers", maddr, "--device-index", "1", name="ok1"
    )
    time.sleep(3)
    odd = roles.start(
        "join", "--config", str(other), "--initial-peers", maddr, "--device-index", "2", name="odd"
    )
    odd.communicate(timeout=120)
    err = (tmp_path / "odd.err").read_text()
    assert odd.returncode == 2 and "differs from the swarm's" in err and "Traceback" not in err
    for p in (first, second):
        roles.kill(p, signal.SIGTERM)
