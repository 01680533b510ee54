"""`collab demo`: a coordinator and N volunteers as real processes; the result equals the simulation."""

from __future__ import annotations

import json

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
