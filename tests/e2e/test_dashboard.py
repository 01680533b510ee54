"""The dashboard in a real headless Chromium, against a live coordinator + monitor + volunteers."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import COLLAB, CONFIGS, REPO
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


def _get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _tiny_text2image(path: Path, steps: int) -> list[str]:
    """A small invite-only text2image run (one layer) with three gallery prompts; returns the prompts."""
    data = yaml.safe_load((CONFIGS / "text2image.yaml").read_text())
    data.update(num_devices=3, max_steps=steps, run_id="dash-t2i", access="invite")
    data["task"].update(layers=1, hidden=32, heads=2, train_scenes=300, eval_scenes=16, batch_size=8)
    data["task"]["prompts"] = data["task"]["prompts"][:3]
    data["method"]["optimizer"]["schedule"]["warmup_steps"] = 5
    path.write_text(yaml.safe_dump(data))
    return list(data["task"]["prompts"])


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (tests/run.sh installs it)")
@pytest.mark.timeout(400)
def test_dashboard_in_chromium(roles: Roles, tmp_path: Path) -> None:
    """An invite-only text2image run with the model keeper: the dashboard shows the live numbers, charts
    with readable axes, the keeper's gallery images and the exact join command; the keeper's last
    checkpoint is the volunteers' final state, and `collab generate` draws from it and from the swarm."""
    steps, invite = 40, "dash-invite-123"
    prompts = _tiny_text2image(tmp_path / "run.yaml", steps)
    model = tmp_path / "model"
    coord = roles.start(
        "coordinator", "--config", str(tmp_path / "run.yaml"), "--port", "0", "--dashboard-port", "0",
        "--db", str(tmp_path / "m.sqlite"), "--authority-key", str(tmp_path / "authority.key"),
        "--invite", invite, "--keep-model", str(model), "--keep-every", "10",
        name="coordinator",
    )  # fmt: skip
    url = roles.read_line(coord, "config server: ")
    dashboard = roles.read_line(coord, "dashboard: ")
    vols = [
        roles.start(
            "join",
            "--coordinator",
            url,
            "--token",
            invite,
            "--device-index",
            str(i),
            "--json",
            "--linger",
            "30",
            name=f"v{i}",
        )
        for i in range(3)
    ]
    finals = [json.loads("{" + roles.read_line(v, "{", timeout_s=300)) for v in vols]
    assert {f["step"] for f in finals} == {steps} and len({f["hash"] for f in finals}) == 1

    # while the volunteers linger: the swarm's current model, downloaded and hash-checked like a joiner's
    drawn = tmp_path / "swarm.png"
    gen = roles.start(
        "generate", "--coordinator", url, "--token", invite, "--prompt", prompts[0], "--n", "2",
        "--out", str(drawn), name="generate",
    )  # fmt: skip
    out, _ = gen.communicate(timeout=120)
    assert gen.returncode == 0, (tmp_path / "generate.err").read_text()[-2000:]
    assert f"from step {steps} written" in out and drawn.read_bytes()[:4] == b"\x89PNG"

    # the keeper keeps the final state (observed: its gallery reaches the last step)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        entries = _get(dashboard + "api/gallery")["entries"]
        if entries and entries[-1]["step"] == steps:  # type: ignore[index]
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the keeper never kept step {steps}: {(model / 'keeper.log').read_text()}")
    for v in vols:  # done lingering for us
        roles.kill(v)
    from collab.methods.checkpoint import open_checkpoint
    from collab.swarm.keeper import kept_steps

    kept = kept_steps(model)
    assert kept[-1] == steps and len(kept) >= 3 and all(b - a >= 10 for a, b in itertools.pairwise(kept[:-1]))
    assert open_checkpoint(model / f"step-{steps:06d}.ckpt").state.hash() == finals[0]["hash"]
    done = subprocess.run(
        [*COLLAB, "generate", "--checkpoint", str(model / f"step-{steps:06d}.ckpt"), "--prompt", prompts[1],
         "--n", "2", "--out", str(tmp_path / "kept.png")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and f"from step {steps}" in done.stdout, done.stderr

    summary = _get(dashboard + "api/summary")
    dom = _chromium(dashboard, tmp_path / "x", "--dump-dom").stdout
    shown_step = int(re.search(r'id="step">(\d+)<', dom).group(1))  # type: ignore[union-attr]
    assert shown_step == summary["global_step"] == steps
    points = [int(p) for p in re.findall(r'data-points="(\d+)"', dom)]
    assert len(points) == 4 and all(p > 1 for p in points), "all four charts must have drawn"
    ticks = re.search(r'id="c-metric"[^>]*data-yticks="([^"]+)"', dom)
    assert ticks is not None and all(re.fullmatch(r"-?\d+(\.\d+)?", t) for t in ticks.group(1).split()), ticks
    assert dom.count("<tr>") >= 1 + 3 + 1 + 3, "peer table and contributors leaderboard list the 3 volunteers"
    # the join panel: the exact command, with this run's invite
    assert f"collab join --coordinator {url} --token {invite}</code>" in dom
    # the gallery: the keeper's images for every prompt, the newest from the last step, all loaded
    images = re.findall(r'<img src="/gallery/(step-\d+-\d+\.png)"[^>]*data-step="(\d+)"[^>]*>', dom)
    assert {int(s) for _, s in images} <= set(kept) and max(int(s) for _, s in images) == steps
    assert len(images) == len(prompts) * min(4, len(kept)), images
    assert dom.count('data-loaded="1"') == len(images), "every gallery image must load"
    for prompt in prompts:
        assert prompt in dom

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    _chromium(dashboard, tmp_path / "y", f"--screenshot={shot}")
    assert shot.exists() and shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000
