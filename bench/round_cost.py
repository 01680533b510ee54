"""The fixed cost of a round: 4 peers on 127.0.0.1 exchanging a small message, round after round.

Usage: ``python bench/round_cost.py [--peers 4] [--rounds 60] [--numel 100] [--ratio 0.25] [--config C]
[--single-owner-bytes N] [--dump FILE]``

Each peer runs in its own spawned process with its own DHT and p2pd, with the swarm settings of
``--config`` (default: configs/demo.yaml): the same matchmaking and exchange a volunteer uses
(``SwarmAggregator``), no operator evaluations. Every round is timed on every peer in two parts,
matchmaking (the group forms) and exchange (the exact reduce of a Top-k message), from a common start
(each peer enters round r+1 as soon as its round r ended, as volunteers do). Reported: the median and
90th percentile over rounds of the slowest peer's time, and the same config's step in ``collab simulate``
(in-process, no network) for comparison. Goal: median round at most 30 ms. ``--dump`` writes the slowest
peer's (matchmaking, exchange, round) seconds of every complete round as JSON (``bench/many_peers.py``
reads it). ``--single-owner-bytes 0`` makes every member own a part, as rounds of large messages do
(default: the config's ``swarm.single_owner_bytes``, under which this message goes through one owner).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _worker(index: int, maddr: str, args: argparse.Namespace, barrier: Any, out: Any) -> None:
    import torch

    from collab.compression import TopK
    from collab.config import load_config
    from collab.methods.base import Contribution, RoundKey
    from collab.swarm import SwarmAggregator, SwarmNode
    from collab.swarm.heartbeat import Heartbeat
    from collab.swarm.records import AliveRecord, PeerStatus

    cfg = load_config(args.config)
    update: dict[str, Any] = {"min_group_size": args.peers, "round_time_s": 1.0}
    if args.single_owner_bytes is not None:
        update["single_owner_bytes"] = args.single_owner_bytes
    swarm = cfg.swarm.model_copy(update=update)
    node = SwarmNode(initial_peers=[maddr])
    agg = SwarmAggregator(node=node, run_id="round-cost", cfg=swarm, device_index=index, shared_seed=1)

    def on_view(view: dict[str, AliveRecord]) -> None:
        agg.matchmaker.alive_peers = view

    # the volunteers' own liveness records: who is expected in every round
    beat = Heartbeat(
        node=node,
        run_id="round-cost",
        cfg=swarm,
        record=lambda: AliveRecord(step=0, status=PeerStatus.TRAINING),
        on_view=on_view,
    )
    while len(agg.matchmaker.alive_peers) < args.peers:
        time.sleep(0.05)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(index))
    msg = TopK(ratio=args.ratio).compress(x, seed=1, step=0)
    barrier.wait()
    times = []
    for r in range(args.rounds):
        key = RoundKey(r, "delta")
        t0 = time.perf_counter()
        try:
            agg.prepare(key)  # matchmaking: the group forms
            t1 = time.perf_counter()
            agg.reduce(key, [Contribution(msg)], server=lambda s: s)
            t2 = time.perf_counter()
            times.append((r, t1 - t0, t2 - t1, agg.last_group_size))
        except Exception as e:  # a failed round is data: reported, not fatal
            times.append((r, float("nan"), float("nan"), 0))
            print(f"peer {index} round {r}: {type(e).__name__}: {e}", flush=True)
    out.put((index, times))
    barrier.wait()
    beat.stop()
    node.shutdown()


def simulate_step_s(config: Path, steps: int) -> float:
    """Median wall-clock of one step of ``collab simulate`` on the same config (in-process)."""
    from collab.config import load_config
    from collab.methods.build import build_method
    from collab.methods.simulated import SimulatedAggregator
    from collab.tasks.build import build_task

    cfg = load_config(config)
    task = build_task(cfg)
    method = build_method(cfg, task, SimulatedAggregator.for_run(cfg), list(range(cfg.num_devices)))
    method.initialize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        method.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--numel", type=int, default=100)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    parser.add_argument("--dump", type=Path, default=None, help="write the per-round times here (JSON)")
    parser.add_argument(
        "--single-owner-bytes",
        type=int,
        default=None,
        help="override swarm.single_owner_bytes (0: every member owns a part)",
    )
    args = parser.parse_args()

    import hivemind

    ctx = mp.get_context("spawn")
    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddr = str(boot.get_visible_maddrs()[0])
    barrier, out = ctx.Barrier(args.peers + 1), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, maddr, args, barrier, out)) for i in range(args.peers)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=300)
        results = dict(out.get(timeout=600) for _ in procs)
        barrier.wait(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        boot.shutdown()

    rounds = []
    for r in range(args.rounds):
        rows = [results[i][r] for i in range(args.peers)]
        if any(row[3] != args.peers for row in rows):
            continue
        rounds.append(
            (max(row[1] for row in rows), max(row[2] for row in rows), max(row[1] + row[2] for row in rows))
        )
    failed = args.rounds - len(rounds)
    sim = simulate_step_s(args.config, 50)

    def q(values: list[float], p: float) -> float:
        return sorted(values)[min(len(values) - 1, int(p * len(values)))]

    print(
        f"\n{args.peers} peers on 127.0.0.1, {args.rounds} rounds, "
        f"{args.numel} coordinates, Top-k {args.ratio:g}"
    )
    from collab.config import load_config

    limit = load_config(args.config).swarm.single_owner_bytes
    limit = limit if args.single_owner_bytes is None else args.single_owner_bytes
    owners = "one owner" if 4 * args.numel * args.peers <= limit else f"{args.peers} owners"
    print(
        f"swarm settings of {args.config.name}; {owners} per round; slowest peer per round; "
        f"{failed} round(s) failed"
    )
    print(f"{'part':<14}{'median ms':>11}{'p90 ms':>9}")
    for name, col in (("matchmaking", 0), ("exchange", 1), ("round", 2)):
        values = [row[col] * 1000 for row in rounds]
        print(f"{name:<14}{statistics.median(values):>11.1f}{q(values, 0.9):>9.1f}")
    total = statistics.median(row[2] for row in rounds)
    print(
        f"simulate step (same config, in-process): {sim * 1000:.2f} ms; "
        f"round / simulate step: {total / sim:.0f}x"
    )
    print(f"goal: median round <= 30 ms: {'met' if total <= 0.030 else 'MISSED'}")
    if args.dump is not None:
        args.dump.write_text(json.dumps({"peers": args.peers, "rounds": rounds}))


if __name__ == "__main__":
    main()
