"""Uneven volunteers: 4 peers on 127.0.0.1, one throttled to 20% of its CPU, collab against hivemind.

Usage::

    python bench/uneven.py [--steps 30] [--round-time 4.0] [--throttle 0.2] [--json]

The problem: the text-to-image transformer of ``configs/text2image.yaml`` made smaller (2 layers, hidden
64), 16 scenes per microbatch, 4 shards. Three phases, one after the other, on the same machine:

1. **Solo rates.** The 4 volunteers compute alone, all at once (the machine shared as in the swarm), for
   ``--solo-s`` seconds each: microbatches of MASHA's work (the operator at two points on the same
   microbatch), volunteer 0 under ``--throttle``. The sum of their samples/s is what the machine can give.
2. **collab.** A bootstrap DHT and 4 ``collab join`` processes (volunteer 0 with ``--throttle``) on the
   config with ``swarm.round_time_s = --round-time``: groups form first, then every member computes
   microbatches for the budget and contributes their mean weighted by samples. Swarm samples/s = the
   samples of every committed step of every peer over the time from the first to the last step. Reported:
   that rate against the solo sum (goal >= 90%), the share of steps the slow volunteer contributed to
   (goal >= 95%), and state downloads after the start (goal 0).
3. **hivemind.** 4 ``hivemind.Optimizer`` peers (Adam, ``use_local_updates=False``, ``batch_size_per_step``
   16, ``target_batch_size`` = collab's mean samples per step) on the same model and shards, each looping
   microbatch -> backward -> ``opt.step()`` (hivemind's usual loop: it accumulates until the swarm reaches
   the target batch, then averages), volunteer 0 throttled the same way, for as many epochs. Reported: its
   samples/s in averaged epochs, how many of the slow peer's samples went into an average, rounds it
   joined and state downloads (from hivemind's own log lines).

Every process is started in its own process group and stopped by it.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_hivemind import _wait_files, start, stop  # bench/ is a folder of scripts

REPO = Path(__file__).resolve().parent.parent
PEERS = 4
BATCH = 16


def config(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load((REPO / "configs" / "text2image.yaml").read_text())
    data.update(num_devices=PEERS, max_steps=args.steps, run_id="uneven")
    data["task"].update(layers=2, hidden=64, heads=4, batch_size=BATCH, train_scenes=4000)
    data["method"]["optimizer"]["schedule"]["warmup_steps"] = min(10, args.steps // 3)
    data["swarm"].update(
        min_group_size=PEERS,  # every round waits for all 4: the budget keeps the slow one from stalling it
        min_matchmaking_time_s=0.3,
        matchmaking_timeout_s=10.0,
        allreduce_timeout_s=10.0,
        round_time_s=args.round_time,
    )
    return data


def _task(data: dict[str, Any]) -> Any:
    from collab.config import parse_config
    from collab.tasks.build import build_task

    return build_task(parse_config(data))


def solo(args: argparse.Namespace) -> None:
    """One volunteer's solo rate: MASHA's microbatch work for ``--solo-s`` seconds; writes JSON."""
    import torch

    from collab.tasks.base import Throttled

    torch.set_num_threads(1)
    task = _task(config(args))
    op = task.local_operator(args._solo)
    if args._throttle < 1:
        op = Throttled(op, args._throttle)
    z = task.initial_point()
    work = Path(args._workdir)
    (work / f"solo-ready-{args._solo}").write_text("1")
    while not (work / "solo-go").exists():
        time.sleep(0.02)
    start_t, done = time.monotonic(), 0
    while time.monotonic() - start_t < args.solo_s:
        op.evaluate([z, z], step=0, microbatch=done)
        done += 1
    rate = done * BATCH / (time.monotonic() - start_t)
    (work / f"solo-{args._solo}.json").write_text(json.dumps({"samples_per_s": rate}))


def run_solo(args: argparse.Namespace, work: Path) -> list[float]:
    procs = []
    try:
        for i in range(PEERS):
            cmd = [sys.executable, __file__, "--_solo", str(i), "--_workdir", str(work)]
            cmd += ["--_throttle", str(args.throttle if i == 0 else 1.0), "--solo-s", str(args.solo_s)]
            procs.append(start(cmd, work / f"solo-{i}.log", cwd=REPO))
        _wait_files(work, [f"solo-ready-{i}" for i in range(PEERS)], procs, 300)
        (work / "solo-go").write_text("1")
        _wait_files(work, [f"solo-{i}.json" for i in range(PEERS)], procs, args.solo_s + 120)
    finally:
        for p in procs:
            stop(p)
    return [json.loads((work / f"solo-{i}.json").read_text())["samples_per_s"] for i in range(PEERS)]


def run_collab(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import hivemind
    import yaml

    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(config(args)))
    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddr = str(boot.get_visible_maddrs()[0])
    procs = []
    try:
        for i in range(PEERS):
            cmd = [sys.executable, "-m", "peers", "join", "--config", str(path), "--initial-peers", maddr]
            cmd += ["--device-index", str(i), "--log-file", str(work / f"collab-{i}.jsonl"), "--json"]
            cmd += ["--linger", "3", "--no-progress"]
            cmd += ["--throttle", str(args.throttle)] if i == 0 else []
            procs.append(start(cmd, work / f"collab-{i}.log", cwd=REPO, env=_env()))
        for p in procs:
            p.wait(timeout=args.case_timeout)
    finally:
        for p in procs:
            stop(p)
        boot.shutdown()
    logs = [
        [json.loads(line) for line in (work / f"collab-{i}.jsonl").read_text().splitlines()]
        for i in range(PEERS)
    ]
    steps = [{r["step"]: r for r in log if "event" not in r} for log in logs]
    last = max(max(s) for s in steps if s)
    first_t = min(s[1]["time"] for s in steps if 1 in s)
    last_t = max(s[last]["time"] for s in steps if last in s)
    # the samples of steps 2..last (step 1's clock starts with its record), every peer's part
    samples = sum(r["samples"] for s in steps for k, r in s.items() if k >= 2)
    per_step = [sum(s[k]["samples"] for s in steps if k in s) for k in range(1, last + 1)]
    downloads = sum(1 for log in logs for r in log if r.get("event") == "sync" and r["step"] > 0)
    hashes = {s[last]["hash"] for s in steps if last in s}
    return {
        "steps": last,
        "samples_per_s": samples / (last_t - first_t),
        "samples_per_step": statistics.mean(per_step),
        "slow_steps": sum(1 for k in range(1, last + 1) if k in steps[0]),
        "slow_share": statistics.mean(r["share"] for r in steps[0].values()),
        "state_downloads": downloads,
        "failed_rounds": sum(1 for log in logs for r in log if r.get("event") == "round_failed"),
        "identical_states": len(hashes) == 1,
        "wall_s": last_t - first_t,
    }


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


class _Counter(logging.Handler):
    """Counts hivemind's own log lines: averaged rounds and state downloads."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.averaged = self.downloads = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.averaged += "Averaged gradients with" in text
        self.downloads += "Downloading parameters from peer" in text


def hivemind_peer(args: argparse.Namespace) -> None:
    """One hivemind.Optimizer peer: microbatch, backward, opt.step() until ``--steps`` epochs."""
    import hivemind
    import torch

    torch.set_num_threads(1)
    task = _task(config(args))
    i, work = args._hivemind_peer, Path(args._workdir)
    op = task.local_operator(i)
    model = op.model.model
    counter = _Counter()
    logging.getLogger("hivemind").addHandler(counter)
    dht = hivemind.DHT(start=True, initial_peers=[args._initial_peer], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    opt = hivemind.Optimizer(
        dht=dht,
        run_id="uneven",
        params=model.parameters(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.003),
        batch_size_per_step=BATCH,
        target_batch_size=args._target,
        use_local_updates=False,
        matchmaking_time=0.3,
        averaging_timeout=30.0,
        verbose=True,
    )
    try:
        (work / f"hm-ready-{i}").write_text("1")
        while not (work / "hm-go").exists():
            time.sleep(0.02)
        t0, computed, used, j = time.time(), 0, 0, 0
        while opt.local_epoch < args.steps:
            started = time.monotonic()
            opt.zero_grad()
            task.problem.loss(model, op.batch(opt.local_epoch, BATCH, j), {}).backward()
            j += 1
            if i == 0 and args.throttle < 1:
                time.sleep((time.monotonic() - started) * (1 - args.throttle) / args.throttle)
            computed += BATCH
            pending = opt.grad_averager.local_samples_accumulated + BATCH
            averaged = counter.averaged
            opt.step()
            if counter.averaged > averaged:
                used += pending  # this peer's accumulated samples went into the round's average
        result = {"computed": computed, "used": used, "t0": t0, "t_end": time.time()}
        result.update(rounds=counter.averaged, downloads=counter.downloads, epochs=opt.local_epoch)
        (work / f"hm-{i}.json").write_text(json.dumps(result))
        (work / f"hm-done-{i}").write_text("1")
        while not all((work / f"hm-done-{k}").exists() for k in range(PEERS)):
            time.sleep(0.05)
    finally:
        opt.shutdown()
        dht.shutdown()


def run_hivemind(args: argparse.Namespace, work: Path, target: int) -> dict[str, Any]:
    import hivemind

    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddr = str(boot.get_visible_maddrs()[0])
    procs = []
    try:
        for i in range(PEERS):
            cmd = [sys.executable, __file__, "--_hivemind-peer", str(i), "--_workdir", str(work)]
            cmd += ["--_initial-peer", maddr, "--_target", str(target), "--steps", str(args.steps)]
            cmd += ["--throttle", str(args.throttle)]
            procs.append(start(cmd, work / f"hm-{i}.log", cwd=REPO, env=_env()))
        _wait_files(work, [f"hm-ready-{i}" for i in range(PEERS)], procs, 300)
        (work / "hm-go").write_text("1")
        _wait_files(work, [f"hm-done-{i}" for i in range(PEERS)], procs, args.case_timeout)
    finally:
        for p in procs:
            stop(p)
        boot.shutdown()
    res = [json.loads((work / f"hm-{i}.json").read_text()) for i in range(PEERS)]
    wall = max(r["t_end"] for r in res) - min(r["t0"] for r in res)
    return {
        "epochs": min(r["epochs"] for r in res),
        "samples_per_s": sum(r["used"] for r in res) / wall,
        "computed_per_s": sum(r["computed"] for r in res) / wall,
        "slow_computed": res[0]["computed"],
        "slow_used": res[0]["used"],
        "slow_rounds": res[0]["rounds"],
        "state_downloads": sum(r["downloads"] for r in res),
        "wall_s": wall,
    }


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="steps (collab) and epochs (hivemind)")
    p.add_argument("--round-time", type=float, default=4.0, help="collab's swarm.round_time_s")
    p.add_argument("--throttle", type=float, default=0.2, help="the slow volunteer's share of its CPU")
    p.add_argument("--solo-s", type=float, default=20.0, help="seconds of the solo-rate phase")
    p.add_argument("--case-timeout", type=float, default=900.0)
    p.add_argument("--workdir", help="keep logs here (default: a temp folder)")
    p.add_argument("--json", action="store_true")
    for hidden in ("--_solo", "--_hivemind-peer", "--_target"):
        p.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    p.add_argument("--_throttle", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--_workdir", help=argparse.SUPPRESS)
    p.add_argument("--_initial-peer", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse()
    if args._solo is not None:
        return solo(args)
    if args._hivemind_peer is not None:
        return hivemind_peer(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="collab-uneven-"))
    work.mkdir(parents=True, exist_ok=True)
    rates = run_solo(args, work)
    print(f"solo samples/s: {[round(r, 1) for r in rates]} (sum {sum(rates):.1f})", flush=True)
    col = run_collab(args, work)
    print(f"collab: {col}", flush=True)
    hm = run_hivemind(args, work, target=round(col["samples_per_step"]))
    print(f"hivemind: {hm}", flush=True)
    solo_sum = sum(rates)
    print()
    print(f"| 4 volunteers, one at {args.throttle:g} of its CPU | collab (round_time_s {args.round_time:g}) "
          "| hivemind.Optimizer | goal |")  # fmt: skip
    print("|---|---:|---:|---|")
    print(f"| samples/s used / solo sum ({solo_sum:.0f}/s) | {col['samples_per_s'] / solo_sum:.0%} "
          f"| {hm['samples_per_s'] / solo_sum:.0%} | >= 90% |")  # fmt: skip
    print(f"| slow volunteer: steps it contributed to | {col['slow_steps']}/{col['steps']} "
          f"| {hm['slow_rounds']}/{hm['epochs']} | >= 95% |")  # fmt: skip
    print(f"| slow volunteer: its samples used | {col['slow_share']:.1%} of each step's "
          f"| {hm['slow_used']} of {hm['slow_computed']} computed | |")  # fmt: skip
    print(f"| state downloads after the start | {col['state_downloads']} | {hm['state_downloads']} | 0 |")
    print(f"| failed rounds (all peers) / identical states | {col['failed_rounds']} / "
          f"{col['identical_states']} | | |")  # fmt: skip
    print(f"(logs in {work})")
    if args.json:
        print(json.dumps({"solo": rates, "collab": col, "hivemind": hm}))


if __name__ == "__main__":
    main()
