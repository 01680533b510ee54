"""Sixteen volunteers on one machine: rounds of 16 members keep one identical state.

Sixteen real `collab join` processes (each with its own DHT process and p2pd) train the demo's bilinear
problem, one shard each. They start together but come up at whatever pace the machine allows: early ones
train in smaller groups, late ones download the state and join. The test watches progress, not the clock:
once every peer has committed 2 steps in rounds of all 16, it stops them and checks that every step's
state hash is the same in every log that has it.
"""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import CONFIGS
from tests.integration.swarm_harness import Swarm, differing_steps

PEERS = 16
FULL_ROUNDS = 2  # rounds of all 16 each peer must commit (one takes 3-5 s on 2 cores)


def _full_steps(records: list[dict[str, object]]) -> set[object]:
    """The steps this peer committed in a round of all the volunteers."""
    return {r["step"] for r in records if "event" not in r and r.get("group") == PEERS}


@pytest.mark.timeout(420)
def test_sixteen_volunteers_keep_one_state(swarm: Swarm) -> None:
    data = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    data.update(num_devices=PEERS, max_steps=100_000, run_id="sixteen")  # stopped by the test
    path = swarm.write_config(data)
    peers = [swarm.start(path, device_index=i) for i in range(PEERS)]

    swarm.wait_until(
        lambda: all(len(_full_steps(p.records())) >= FULL_ROUNDS for p in peers),
        360,
        f"every peer to commit {FULL_ROUNDS} rounds of {PEERS}",
    )
    for p in peers:
        assert p.proc.poll() is None, f"peer {p.index} stopped:\n{p.err.read_text()[-2000:]}"
        swarm.kill(p)

    split = differing_steps([p.steps() for p in peers])
    assert not split, f"states differ at steps {sorted(split)[:10]}"
    # a round of 16 is a round of everyone: each such step is in every log
    full = [_full_steps(p.records()) for p in peers]
    assert len(set.intersection(*full)) >= FULL_ROUNDS, full
