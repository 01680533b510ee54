"""The swarm's wall-clock against the simulation's: ``collab demo`` vs ``collab simulate``, same config.

Usage: ``python bench/demo_vs_simulate.py [--config configs/demo.yaml] [--peers 4] [--steps 300]``

Runs ``collab simulate`` (all shards in one process, no network) and ``collab demo`` (a coordinator and
``--peers`` volunteers on 127.0.0.1) of the same config and steps, one after the other. The demo's time is
its rounds: from the first volunteer's initial state to the last volunteer's last step (process start-up
and the DHT bootstrap excluded, as the simulation has neither); the simulation's is its whole run. Also
reported: whether the demo's final state equals the simulation's (it does when every round holds every
volunteer and torch uses the same thread count; see ``collab demo --help``). Goal: the demo within 3x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def collab(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "peers", *args], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"collab {args[0]} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout


def rounds_time(work: Path, peers: int) -> float:
    starts, ends = [], []
    for i in range(peers):
        lines = [json.loads(x) for x in (work / f"volunteer-{i}.jsonl").read_text().splitlines() if x]
        starts.append(min(r["time"] for r in lines if r.get("event") in ("initialized", "sync")))
        ends.append(max(r["time"] for r in lines if "event" not in r))
    return max(ends) - min(starts)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=1, help="torch threads in every process")
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}

    with tempfile.TemporaryDirectory() as tmp:
        data = yaml.safe_load(args.config.read_text())
        data.update(num_devices=args.peers, max_steps=args.steps)  # what the demo runs
        config = Path(tmp) / "run.yaml"
        config.write_text(yaml.safe_dump(data))
        t0 = time.perf_counter()
        sim_args = ["simulate", "--config", str(config), "--all-steps", "--no-progress"]
        sim_out = collab(*sim_args, "--metrics", str(Path(tmp) / "m.csv"), "--json", env=env)
        sim = json.loads(sim_out.strip().splitlines()[-1])
        sim_s = time.perf_counter() - t0
        work = Path(tmp) / "demo"
        t0 = time.perf_counter()
        demo_args = ["demo", "--config", str(args.config), "--peers", str(args.peers)]
        demo_out = collab(
            *demo_args, "--max-steps", str(args.steps), "--workdir", str(work), "--json", env=env
        )
        demo = json.loads(demo_out.strip().splitlines()[-1])
        demo_total = time.perf_counter() - t0
        demo_s = rounds_time(work, args.peers)
    hashes = set(demo["state_hashes"].values())
    same = hashes == {sim.get("state_hash")}
    print(f"\n{args.config.name}: {args.peers} shards, {args.steps} steps, {args.threads} torch thread(s)")
    print(f"collab simulate:           {sim_s:8.1f} s")
    print(f"collab demo, rounds:       {demo_s:8.1f} s   ({demo_total:.1f} s with start-up)")
    print(f"demo / simulate:           {demo_s / sim_s:8.1f}x   (goal <= 3x)")
    print(f"demo state equals simulation's: {same} ({len(hashes)} distinct hash(es) among volunteers)")


if __name__ == "__main__":
    main()
