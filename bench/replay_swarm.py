"""Replay a swarm run in simulation and find the first step where the swarm's state departs from it.

Usage::

    python bench/replay_swarm.py --workdir runs/t2i [--volunteer 0]

Reads the run config a ``collab demo`` wrote (``run.yaml``) and a volunteer's step log, runs the method
in one process with every device (``collab simulate``'s computation) and compares the state hash after
every step. Use the same torch thread count as the volunteers (CPU float sums depend on it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--workdir", required=True, help="a collab demo's workdir (run.yaml, volunteer-N.jsonl)")
    p.add_argument("--volunteer", type=int, default=0, help="whose log to compare with (default 0)")
    args = p.parse_args()

    import torch

    from collab.config import load_config
    from collab.methods.build import build_method
    from collab.methods.simulated import SimulatedAggregator
    from collab.tasks.build import build_task

    work = Path(args.workdir)
    cfg = load_config(work / "run.yaml")
    swarm: dict[int, str] = {}
    for line in (work / f"volunteer-{args.volunteer}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "event" not in record or record["event"] in ("initialized", "sync"):
            # a step's line, or the state adopted at that step; after a download the last one wins
            swarm[record["step"]] = record["hash"]
    task = build_task(cfg)
    method = build_method(cfg, task, SimulatedAggregator.for_run(cfg), range(cfg.num_devices))
    method.initialize()
    last = max(swarm)
    while method.state is not None and method.state.step < last:
        method.step()
        step = method.state.step
        if swarm.get(step) != method.state.hash():
            print(f"the swarm equals the simulation up to step {step - 1}; step {step} differs "
                  f"({torch.get_num_threads()} torch threads)")  # fmt: skip
            return
    threads = torch.get_num_threads()
    print(f"the swarm equals the simulation at every step up to {last} ({threads} torch threads)")


if __name__ == "__main__":
    main()
