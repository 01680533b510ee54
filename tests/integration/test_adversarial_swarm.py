"""The adversarial transformer task on 2 real peers: finite loss that falls, identical states."""

from __future__ import annotations

import math

import pytest
import yaml

from tests.conftest import CONFIGS
from tests.integration.swarm_harness import Swarm

STEPS = 20


@pytest.mark.timeout(240)
def test_adversarial_two_peers_loss_falls(swarm: Swarm) -> None:
    data = yaml.safe_load((CONFIGS / "adversarial.yaml").read_text())
    data.update(num_devices=2, max_steps=STEPS)
    data["swarm"]["min_group_size"] = 2
    path = swarm.write_config(data)
    peers = [swarm.start(path, i) for i in range(2)]
    summaries = [swarm.finish(p, timeout_s=200) for p in peers]
    assert len({s["hash"] for s in summaries}) == 1
    losses = [r["metric"] for r in peers[0].records() if "event" not in r]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.05, f"the loss must fall on average: {first:.3f} -> {last:.3f}"
    for a, b in zip(peers[0].steps().items(), peers[1].steps().items(), strict=True):
        assert a == b
