"""One aggregation round among 4 peers on loopback: stock hivemind averager vs collab's exact reducer.

Usage: ``python bench/aggregation.py [--numel 10000000] [--peers 4] [--ratio 0.01] [--repeats 2]``

Cases, run one after the other, each in fresh peer processes (spawned, one DHT and p2pd each):

* ``hivemind DecentralizedAverager`` (NoCompression butterfly all-reduce, target_group_size = peers);
* ``collab dense exact``   - the exact reduce-scatter on the dense vector;
* ``collab Rand-k``        - shared-seed Rand-k message (values only on the wire);
* ``collab Top-k``         - Top-k message (indices + values, partitioned by coordinate range).

A round is timed on every peer from a common barrier to its return, matchmaking included; the slowest
peer counts. Bytes: the loopback interface's transmitted bytes over the round divided by the number of
peers (everything that crossed the network: payload, libp2p/TCP framing, DHT traffic), and for collab also
the payload frames its own transport counted. Ratios are to the stock averager, measured in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

from loopback import lo_tx_bytes


def _worker(
    case: str, index: int, maddr: str, numel: int, peers: int, ratio: float, barrier: Any, out: Any
) -> None:
    import torch

    mp.set_start_method("fork", force=True)  # hivemind's averager and DHT run as forked children
    x = torch.randn(numel, generator=torch.Generator().manual_seed(index))
    if case == "hivemind":
        import hivemind

        dht = hivemind.DHT(start=True, initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        avg = hivemind.averaging.DecentralizedAverager(
            averaged_tensors=[x],
            dht=dht,
            prefix="bench",
            target_group_size=peers,
            min_matchmaking_time=0.5,  # the group fills at once here; keep hivemind's wait short too
            request_timeout=0.4,
            start=True,
        )
        barrier.wait()
        t0 = time.perf_counter()
        result = avg.step(timeout=120)
        elapsed = time.perf_counter() - t0
        out.put((case, index, elapsed, None, None, result is not None and len(result) == peers))
        barrier.wait()
        avg.shutdown()
        dht.shutdown()
        return

    from collab.compression import Identity, RandK, TopK
    from collab.config import SwarmConfig
    from collab.methods.base import Contribution, RoundKey
    from collab.swarm import SwarmAggregator, SwarmNode

    node = SwarmNode(initial_peers=[maddr])
    cfg = SwarmConfig(
        min_group_size=peers, target_group_size=peers, matchmaking_timeout_s=60, allreduce_timeout_s=120
    )
    agg = SwarmAggregator(node=node, run_id="bench", cfg=cfg, device_index=index, shared_seed=1)
    comp = {"dense": Identity(), "randk": RandK(ratio=ratio), "topk": TopK(ratio=ratio)}[case]
    msg = comp.compress(x, seed=1, step=0)
    barrier.wait()
    t0 = time.perf_counter()
    agg.reduce(RoundKey(0, case), [Contribution(msg)], server=lambda s: s)
    elapsed = time.perf_counter() - t0
    out.put(
        (
            case,
            index,
            elapsed,
            agg.stats.wire_bytes_sent,
            agg.stats.wire_bytes_received,
            agg.last_group_size == peers,
        )
    )
    barrier.wait()
    node.shutdown()


def run_case(case: str, args: argparse.Namespace) -> dict[str, float]:
    import hivemind

    ctx = mp.get_context("spawn")
    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddr = str(boot.get_visible_maddrs()[0])
    barrier, out = ctx.Barrier(args.peers + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(case, i, maddr, args.numel, args.peers, args.ratio, barrier, out))
        for i in range(args.peers)
    ]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=300)  # everyone is up
        tx0 = lo_tx_bytes()
        results = [out.get(timeout=300) for _ in procs]
        tx1 = lo_tx_bytes()
        barrier.wait(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        boot.shutdown()
    assert all(r[5] for r in results), f"{case}: not every peer averaged with the full group"
    sent = [r[3] for r in results if r[3] is not None]
    recv = [r[4] for r in results if r[4] is not None]
    return {
        "time_s": max(r[2] for r in results),
        "lo_bytes_per_peer": (tx1 - tx0) / args.peers,
        "frame_sent_per_peer": sum(sent) / len(sent) if sent else float("nan"),
        "frame_recv_per_peer": sum(recv) / len(recv) if recv else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=1, help="rounds per case (best time is kept)")
    args = parser.parse_args()

    names = {
        "hivemind": "hivemind DecentralizedAverager",
        "dense": "collab dense exact",
        "randk": f"collab Rand-k {args.ratio:g}",
        "topk": f"collab Top-k {args.ratio:g}",
    }
    rows = {}
    for case in names:
        best = None
        for _ in range(args.repeats):
            res = run_case(case, args)
            if best is None or res["time_s"] < best["time_s"]:
                best = res
        assert best is not None
        rows[case] = best
        print(f"done: {names[case]}", flush=True)
    base = rows["hivemind"]
    print(f"\n{args.peers} peers, {args.numel:,} fp32 values, one round each (loopback)")
    head = f"{'case':<32}{'round s':>9}{'MB/peer (lo)':>14}{'payload MB sent':>17}"
    print(head + f"{'bytes vs stock':>16}{'speed vs stock':>16}")
    for case, r in rows.items():
        payload = r["frame_sent_per_peer"] / 1e6
        print(
            f"{names[case]:<32}{r['time_s']:>9.3f}{r['lo_bytes_per_peer'] / 1e6:>14.2f}"
            f"{payload:>17.3f}{r['lo_bytes_per_peer'] / base['lo_bytes_per_peer']:>16.4f}"
            f"{base['time_s'] / r['time_s']:>15.1f}x"
        )


if __name__ == "__main__":
    main()
