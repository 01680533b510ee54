"""100M-parameter rounds and state sync among 3 peers on loopback, against hivemind's averager.

Usage: ``python bench/scale.py [--numel 100000000] [--peers 3] [--ratio 0.01] [--repeat 3] [--no-memory]
[--warmup]``

Cases, one after the other, each in fresh peer processes (spawned; one DHT and p2pd each):

* ``hivemind DecentralizedAverager`` - one dense all-reduce round of ``numel`` fp32 values (no compression);
* ``collab dense exact``  - the same values through collab's exact reducer (a dense refresh round);
* ``collab Top-k``        - a sparse MASHA round (Top-k ``ratio`` of the same values);
* ``collab state sync``   - a late joiner downloads a 3-tensor state (``z``, ``w``, ``fw``: ``numel`` fp32
  values each, the shape of a MASHA state) from a peer that serves it in chunks, checked as they arrive.

Each case runs twice: timed, then with memory sampling (which slows large processes; see PeakMemory).
``--warmup``: the round cases (hivemind's included) run one untimed round first and time the second, in
the same processes - a run's steady state, where each round's fresh buffers get memory that earlier
rounds freed (on this VM a page touched for the first time costs a host fault: the cold single round of
the default measures that too). The wire bytes then count the timed round only; the peak, both.
Per case: the slowest peer's time (from a common barrier to its return; rounds include matchmaking),
the loopback interface's transmitted bytes per peer, and each peer's peak memory: the proportional set
size (PSS, so shared pages count once) of the peer's whole process tree - the Python process, its DHT
process, its p2pd daemon and, for hivemind, the averager's process - sampled every 50 ms. Ratios are to
the data a peer holds (the round's vector, or the state) and to hivemind, measured in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from loopback import lo_tx_bytes

CHUNK_BYTES = 8 * 1024**2
SYNC_TRIES = 4  # a download that breaks off resumes from the next chunk, from the next source


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [root], [root]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        out += frontier
    return out


def _pss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


class PeakMemory:
    """The peak PSS of this process's tree, sampled in a thread until ``stop()``.

    Reading a large process's PSS costs the kernel a walk over its page tables: sampling every 50 ms
    slowed a 100M-value case by half on 2 cores, so timed runs do not sample (``enabled=False``: the
    peak reads 0) and memory comes from a second, sampled run of the same case."""

    def __init__(self, interval_s: float = 0.05, *, enabled: bool = True) -> None:
        self.peak, self.interval_s = 0, interval_s
        self._stop = threading.Event()
        self._pids = _tree(os.getpid())
        self._thread = threading.Thread(target=self._run, daemon=True)
        if enabled:
            self._thread.start()

    def _run(self) -> None:
        rounds = 0
        while not self._stop.is_set():
            if rounds % 20 == 0:  # new children (the DHT, p2pd, an averager) appear as the peer starts
                self._pids = _tree(os.getpid())
            self.peak = max(self.peak, _pss_bytes(self._pids))
            rounds += 1
            self._stop.wait(self.interval_s)

    def now(self) -> int:
        """The tree's PSS now (its processes looked up afresh)."""
        self._pids = _tree(os.getpid())
        return _pss_bytes(self._pids)

    def stop(self) -> int:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak


def _round_worker(
    case: str, index: int, maddr: str, args: argparse.Namespace, barrier: Any, out: Any
) -> None:
    import torch

    mp.set_start_method("fork", force=True)  # hivemind's averager and DHT run as forked children
    memory = PeakMemory(enabled=args.sample)
    if case == "hivemind":
        import hivemind

        dht = hivemind.DHT(start=True, initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        base = memory.now()
        x = torch.randn(args.numel, generator=torch.Generator().manual_seed(index))
        avg = hivemind.averaging.DecentralizedAverager(
            averaged_tensors=[x],
            dht=dht,
            prefix="bench",
            target_group_size=args.peers,
            min_matchmaking_time=0.5,  # the group fills at once here; keep hivemind's wait short too
            request_timeout=2.0,
            start=True,
        )
        barrier.wait()
        if args.warmup:  # an untimed round first: the timed one is a run's steady state
            avg.step(timeout=600)
            barrier.wait()
        t0 = time.perf_counter()
        result = avg.step(timeout=600)
        elapsed = time.perf_counter() - t0
        ok = result is not None and len(result) == args.peers
        barrier.wait()
        out.put((index, elapsed, ok, memory.stop(), 4 * args.numel, base))
        avg.shutdown()
        dht.shutdown()
        return

    from collab.compression import Identity, TopK
    from collab.config import SwarmConfig
    from collab.methods.base import Contribution, RoundKey
    from collab.swarm import SwarmAggregator, SwarmNode

    node = SwarmNode(initial_peers=[maddr], max_message_bytes=8 * args.numel + 2**20)
    cfg = SwarmConfig(
        min_group_size=args.peers,
        target_group_size=args.peers,
        matchmaking_timeout_s=60,
        allreduce_timeout_s=600,
        max_message_bytes=8 * args.numel + 2**20,
    )
    agg = SwarmAggregator(node=node, run_id="bench", cfg=cfg, device_index=index, shared_seed=1)
    base = memory.now()
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(index))
    comp = Identity() if case == "dense" else TopK(ratio=args.ratio)
    msg = comp.compress(x, seed=1, step=0)
    barrier.wait()
    if args.warmup:  # an untimed round first (its aggregate dropped, as a run drops old buffers)
        agg.reduce(RoundKey(0, case), [Contribution(msg)], server=lambda s: s)
        barrier.wait()
    t0 = time.perf_counter()
    agg.reduce(RoundKey(1, case), [Contribution(msg)], server=lambda s: s)
    elapsed = time.perf_counter() - t0
    ok = agg.last_group_size == args.peers
    barrier.wait()
    out.put((index, elapsed, ok, memory.stop(), 4 * args.numel, base))
    node.shutdown()


def _sync_worker(case: str, index: int, maddr: str, args: argparse.Namespace, barrier: Any, out: Any) -> None:
    import torch

    from collab.config import SwarmConfig
    from collab.methods.base import MethodState
    from collab.swarm import SwarmNode
    from collab.swarm.state_sync import Partial, StateRejected, StateServer, StateSource, download_state
    from collab.swarm.timing import Timing

    memory = PeakMemory(enabled=args.sample)
    node = SwarmNode(initial_peers=[maddr])
    state_bytes = 3 * 4 * args.numel
    joiner = index == args.peers - 1
    base = memory.now()
    if not joiner:  # every other peer holds the run's state and serves it
        g = torch.Generator().manual_seed(0)
        tensors = [torch.randn(args.numel, generator=g) for _ in range(3)]
        state = MethodState(step=1, z=tensors[0], w=tensors[1], fw=tensors[2])
        state.hash()  # a volunteer hashes each state once, when its group commits it (for its records)
        StateServer(
            node, state=lambda: state, method="masha2", config_version="bench", chunk_bytes=CHUNK_BYTES
        )
        out.put(("key", node.peer_key))
        barrier.wait()  # everyone is up
        barrier.wait()  # the joiner is done
        out.put((index, 0.0, True, memory.stop(), state_bytes, base))
        node.shutdown()
        return
    barrier.wait()
    timing = Timing.of(SwarmConfig(state_sync_timeout_s=600))
    source = StateSource(config_version="bench", method="masha2", timing=timing)
    partial, got, breaks = Partial(), None, []
    marks: dict[str, float] = {}

    def progress(held: int, total: int) -> None:  # when the manifest came, when the last chunk did
        marks.setdefault("manifest", time.perf_counter())
        if held == total:
            marks["chunks"] = time.perf_counter()

    t0 = time.perf_counter()
    for attempt in range(SYNC_TRIES):  # as a volunteer does: keep the chunks, go on from the next source
        try:
            got = download_state(
                node,
                args.source_keys[attempt % len(args.source_keys)],
                source,
                partial=partial,
                progress=progress,
            )
            break
        except StateRejected as e:
            breaks.append(f"try {attempt + 1}: {e} (kept {partial.received} chunks)")
    elapsed = time.perf_counter() - t0
    for line in breaks:
        print(f"state sync: {line}", flush=True)
    if marks:
        print(
            f"state sync: manifest after {marks['manifest'] - t0:.2f} s, chunks "
            f"{marks.get('chunks', 0) - marks['manifest']:.2f} s, checked and adopted after "
            f"{elapsed:.2f} s",
            flush=True,
        )
    if got is None:
        raise RuntimeError(f"no state after {SYNC_TRIES} tries")
    ok = got.state.step == 1 and got.state.z.numel() == args.numel
    barrier.wait()
    out.put((index, elapsed, ok, memory.stop(), state_bytes, base))
    node.shutdown()


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    import hivemind

    ctx = mp.get_context("spawn")
    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddr = str(boot.get_visible_maddrs()[0])
    barrier, out = ctx.Barrier(args.peers + 1), ctx.Queue()
    target = _sync_worker if case == "sync" else _round_worker
    procs = []
    try:
        if case == "sync":  # the sources first: the joiner needs one's key
            for i in range(args.peers - 1):
                procs.append(ctx.Process(target=target, args=(case, i, maddr, args, barrier, out)))
                procs[-1].start()
            keys = [out.get(timeout=600) for _ in range(args.peers - 1)]
            joiner_args = argparse.Namespace(**vars(args), source_keys=[k[1] for k in keys])
            procs.append(
                ctx.Process(target=target, args=(case, args.peers - 1, maddr, joiner_args, barrier, out))
            )
            procs[-1].start()
        else:
            for i in range(args.peers):
                procs.append(ctx.Process(target=target, args=(case, i, maddr, args, barrier, out)))
                procs[-1].start()
        barrier.wait(timeout=900)  # everyone is up
        if args.warmup and case != "sync":
            barrier.wait(timeout=900)  # the untimed round is over
        tx0 = lo_tx_bytes()
        barrier.wait(timeout=900)  # everyone is done
        tx1 = lo_tx_bytes()
        results = sorted(out.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
        boot.shutdown()
    assert all(r[2] for r in results), f"{case}: a peer did not finish the round with the full group"
    return {
        "time_s": max(r[1] for r in results),
        "lo_bytes_per_peer": (tx1 - tx0) / args.peers,
        "peak_bytes": max(r[3] for r in results),
        "peaks": [r[3] for r in results],
        "data_bytes": results[0][4],
        # the most any peer grew over its own tree's size before it allocated the data
        "growth_bytes": max(r[3] - r[5] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--cases", default="hivemind,dense,topk,sync", help="comma-separated subset")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory-sampled second runs")
    parser.add_argument(
        "--warmup",
        action="store_true",
        help="time each round case's second round in the same processes (steady state: a training run's "
        "rounds reuse memory its earlier rounds freed); the first is untimed. Both systems alike",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed runs of each case, interleaved; the median is reported"
    )
    args = parser.parse_args()

    names = {
        "hivemind": "hivemind DecentralizedAverager",
        "dense": "collab dense exact",
        "topk": f"collab Top-k {args.ratio:g}",
        "sync": "collab state sync (late joiner)",
    }
    names = {k: v for k, v in names.items() if k in args.cases.split(",")}
    rows: dict[str, dict[str, Any]] = {}
    times: dict[str, list[float]] = {case: [] for case in names}
    # timed without memory sampling, the cases interleaved run after run (this machine's speed drifts:
    # each ratio compares runs of the same minutes), then each case once sampled for memory (PeakMemory)
    for attempt in range(max(1, args.repeat)):
        for case in names:
            timed = run_case(case, argparse.Namespace(**vars(args), sample=False))
            times[case].append(timed["time_s"])
            rows.setdefault(case, timed)
            print(f"run {attempt + 1}: {names[case]} {timed['time_s']:.2f} s", flush=True)
    for case in names:
        sampled = (
            rows[case] if args.no_memory else run_case(case, argparse.Namespace(**vars(args), sample=True))
        )
        rows[case] = {**sampled, "time_s": statistics.median(times[case]), "times_s": times[case]}
        print(f"done: {names[case]} {rows[case]}", flush=True)
    base = rows.get("hivemind")
    print(f"\n{args.peers} peers, {args.numel:,} fp32 values, loopback, median of {max(1, args.repeat)} runs")
    print(
        f"{'case':<34}{'time s':>8}{'MB/peer (lo)':>14}{'vs hivemind':>13}{'peak GB':>9}{'peak/data':>11}"
        f"{'growth/data':>13}{'MB/s':>8}"
    )
    for case, r in rows.items():
        speed = f"{base['time_s'] / r['time_s']:.2f}x" if base and case != "sync" else "-"
        rate = f"{r['data_bytes'] / r['time_s'] / 1e6:.0f}" if case == "sync" else "-"
        print(
            f"{names[case]:<34}{r['time_s']:>8.2f}{r['lo_bytes_per_peer'] / 1e6:>14.1f}{speed:>13}"
            f"{r['peak_bytes'] / 1e9:>9.2f}{r['peak_bytes'] / r['data_bytes']:>11.2f}"
            f"{r['growth_bytes'] / r['data_bytes']:>13.2f}{rate:>8}"
        )
    print(
        "time: the median of runs without memory sampling; peak: the largest peer's PSS over its process "
        "tree, from one more run of the case sampled every 50 ms; growth: the most a peer's tree grew over "
        "its size before it allocated the data (the vector of a round, the state of a sync)"
    )
    for case, r in rows.items():
        runs = ", ".join(f"{t:.2f}" for t in r["times_s"])
        ratios = ""
        if base and case not in (
            "hivemind",
            "sync",
        ):  # run by run, against hivemind's run of the same minutes
            each = [h / t for h, t in zip(base["times_s"], r["times_s"], strict=True)]
            ratios = " (vs hivemind run by run: " + ", ".join(f"{x:.2f}x" for x in each) + ")"
        print(f"{names[case]}: runs {runs} s{ratios}")


if __name__ == "__main__":
    main()
