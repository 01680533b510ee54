"""The standalone monitor process: history survives a restart (SIGKILL), and it runs without torch."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import CONFIGS
from tests.e2e.roles import Roles


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _wait_history(dashboard: str, predicate: Any, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = _get(dashboard + "api/history")
        if predicate(rows):
            return rows
        time.sleep(0.5)
    raise AssertionError(f"history never got there: {rows[-3:]}")


@pytest.mark.timeout(300)
def test_monitor_restart_keeps_history_and_loads_no_torch(roles: Roles, tmp_path: Path) -> None:
    data = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    data.update(num_devices=2, max_steps=100_000)  # the volunteers leave (SIGTERM) once the checks are done
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(data))
    db = str(tmp_path / "monitor.sqlite")
    coord = roles.start("coordinator", "--config", str(cfg), "--port", "0", name="coordinator")
    url = roles.read_line(coord, "config server: ")
    monitor_args = ("monitor", "--coordinator", url, "--port", "0", "--db", db, "--poll-interval", "0.5")
    mon = roles.start(*monitor_args, name="monitor1")
    dashboard = roles.read_line(mon, "dashboard: ")
    vols = [
        roles.start(
            "join", "--coordinator", url, "--device-index", str(i), "--json", "--linger", "0", name=f"v{i}"
        )
        for i in range(2)
    ]
    first = _wait_history(dashboard, lambda rows: len(rows) >= 5, 120)

    # The monitor process never maps libtorch: it reads the DHT through hivemind's DHT modules alone.
    maps = Path(f"/proc/{mon.pid}/maps").read_text()
    assert "libtorch" not in maps, "the standalone monitor must not load torch"

    roles.kill(mon, signal.SIGKILL)  # a crash, not a clean exit: every stored row must still be there
    mon2 = roles.start(*monitor_args, name="monitor2")
    dashboard2 = roles.read_line(mon2, "dashboard: ")
    reloaded = _get(dashboard2 + "api/history")
    assert [r["global_step"] for r in reloaded[: len(first)]] == [r["global_step"] for r in first]
    last = first[-1]["global_step"]
    cont = _wait_history(dashboard2, lambda rows: rows and rows[-1]["global_step"] > last + 5, 120)
    steps = [r["global_step"] for r in cont]
    assert steps == sorted(steps), "history stays in step order across the restart"
    for v in vols:
        v.send_signal(signal.SIGTERM)
    for i, v in enumerate(vols):
        roles.summary(v, 60, f"v{i}")
    contributors = _get(dashboard2 + "api/contributors")
    assert len(contributors) == 2
