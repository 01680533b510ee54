"""Without a coordinator, the majority of the alive peers says which config is the run's.

Two real peers train with config A (no coordinator: they meet through a bootstrap DHT). A third starts with
config B (the same run id, another stepsize). It reads the others' alive records (each names its config
version), finds itself in the minority and exits with one clear line and the bad-input exit code, never
having committed a step; the majority keeps training (it has far more steps to go than the test
watches, so the odd peer always meets it, however slowly it starts) with identical states at every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from collab.config import RunConfig
from tests.conftest import CONFIGS
from tests.integration.swarm_harness import Swarm

STEPS = 100_000  # never reached: the majority is still training whenever the odd peer looks
EXIT_BAD_INPUT = 2


def _config(gamma: float) -> dict[str, Any]:
    data = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    data.update(num_devices=3, max_steps=STEPS, run_id="majority")
    data["method"]["gamma"] = gamma
    data["swarm"]["min_group_size"] = 2
    return data


@pytest.mark.timeout(240)
def test_a_peer_with_another_config_meets_the_majority_and_stops(swarm: Swarm) -> None:
    a_data, b_data = _config(0.2), _config(0.15)
    a_path = swarm.write_config(a_data)
    b_path = swarm.tmp / "other.yaml"
    b_path.write_text(yaml.safe_dump(b_data))
    versions = {RunConfig.model_validate(d).version() for d in (a_data, b_data)}
    assert len(versions) == 2, "the two configs must differ in version"

    majority = [swarm.start(a_path, device_index=i) for i in (0, 1)]
    # the majority has trained (so both alive records are there) before the odd one comes
    swarm.wait_until(lambda: min(p.last_step() for p in majority) >= 3, 120, "the majority to train")
    odd = swarm.start(b_path, device_index=2)
    try:
        odd.proc.communicate(timeout=120)
    except Exception:
        swarm.kill(odd)
        raise AssertionError(f"the odd peer kept running:\n{odd.err.read_text()[-2000:]}") from None
    err = odd.err.read_text()
    assert odd.proc.returncode == EXIT_BAD_INPUT, f"exit {odd.proc.returncode}:\n{err[-2000:]}"
    assert "Traceback" not in err, err[-2000:]
    assert "differs from the swarm's" in err, err[-2000:]
    assert not odd.steps(), "the odd peer committed steps with the wrong config"

    at_exit = min(p.last_step() for p in majority)
    swarm.wait_until(lambda: min(p.last_step() for p in majority) >= at_exit + 5, 120, "more steps")
    for p in majority:
        assert p.proc.poll() is None, f"a majority peer stopped:\n{p.err.read_text()[-2000:]}"
        swarm.kill(p)
    first, second = (p.steps() for p in majority)
    common = sorted(set(first) & set(second))
    assert len(common) >= 8, common
    assert all(first[s] == second[s] for s in common), "the majority's states differ"
