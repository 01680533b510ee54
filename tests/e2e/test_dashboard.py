"""The dashboard in a real headless Chromium, against a live coordinator + monitor + volunteers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import CONFIGS, REPO
from tests.e2e.roles import Roles

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "test-artifacts"


def _chromium(url: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={out.parent / 'chromium-profile'}",
        "--window-size=1200,1100", "--virtual-time-budget=8000",
    ]  # fmt: skip
    return subprocess.run(
        [CHROMIUM, *flags, *extra, url], capture_output=True, text=True, timeout=90, check=False
    )


def _summary(dashboard: str) -> dict[str, object]:
    with urllib.request.urlopen(dashboard + "api/summary", timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (installed by .ci/run)")
@pytest.mark.timeout(300)
def test_dashboard_in_chromium(roles: Roles, tmp_path: Path) -> None:
    data = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    data.update(num_devices=3, max_steps=120)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(data))
    db = str(tmp_path / "m.sqlite")
    coord = roles.start(
        "coordinator",
        "--config",
        str(cfg),
        "--port",
        "0",
        "--dashboard-port",
        "0",
        "--db",
        db,
        name="coordinator",
    )
    url = roles.read_line(coord, "config server: ")
    dashboard = roles.read_line(coord, "dashboard: ")
    vols = [
        roles.start(
            "join", "--coordinator", url, "--device-index", str(i), "--json", "--linger", "0", name=f"v{i}"
        )
        for i in range(3)
    ]
    for i, v in enumerate(vols):
        roles.summary(v, 200, f"v{i}")
    deadline = time.monotonic() + 30
    while _summary(dashboard).get("global_step") != 120 and time.monotonic() < deadline:
        time.sleep(0.5)

    before = _summary(dashboard)
    dom = _chromium(dashboard, tmp_path / "x", "--dump-dom").stdout
    after = _summary(dashboard)
    shown_step = int(re.search(r'id="step">(\d+)<', dom).group(1))  # type: ignore[union-attr]
    shown_alive = int(re.search(r'id="alive">(\d+)<', dom).group(1))  # type: ignore[union-attr]
    assert shown_step == before["global_step"] == after["global_step"] == 120
    assert shown_alive in (before["alive_peers"], after["alive_peers"])
    assert shown_alive == 3 or after["alive_peers"] != before["alive_peers"]
    points = [int(p) for p in re.findall(r'data-points="(\d+)"', dom)]
    assert len(points) == 4 and all(p > 1 for p in points), "all four charts must have drawn"
    assert dom.count("<tr>") >= 1 + 3 + 1 + 3, "peer table and contributors leaderboard list the 3 volunteers"

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    _chromium(dashboard, tmp_path / "y", f"--screenshot={shot}")
    assert shot.exists() and shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000
