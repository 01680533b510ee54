"""Many peers: time per step and failed rounds for 100 and 1,000 volunteers, today's protocol vs the design.

Usage: ``python bench/many_peers.py --round-cost R2.json R4.json R8.json [--chaos DIR] [--trials 1000]``

A Monte Carlo model fed with measured inputs (docs/ARCHITECTURE.md, "Many peers"):

* **Round times** (``bench/round_cost.py --dump``, several group sizes on 127.0.0.1): the slowest member's
  matchmaking + exchange + confirmation per round. The per-member latency distribution is taken as the
  measured slowest-of-``n0`` distribution to the power ``1/n0`` (members independent), so a group of ``m``
  draws its round time at quantile ``u^(n0/m)`` of the measurement - past the largest value measured the
  tail is cut off (optimistic for large groups). The cost of each further member (its joins, parts and
  confirmations to handle) is the least-squares slope of the median round over the measured sizes.
* **Failures** (``--chaos``: the directory of a ``tests/integration/test_chaos.py`` run, e.g. its pytest
  tmp dir): kills per peer-second, and the time a kill costs the survivors (the gap between the commits
  around a failed round, less a median step). The chaos test kills far more often than volunteers leave,
  so a second rate is shown: a volunteer session of one hour on average (an assumption, not a
  measurement). On loopback a dead peer's port refuses at once; on the Internet a dead peer is silent and
  is found out by the part call's timeout (``allreduce_timeout_s`` + margin of ``configs/demo.yaml``).
* **Compute**: every round also computes for ``--compute-s`` (a round budget), during which members can
  fail too.

Today's protocol: one group of all alive peers per step; a member that fails fails the round, which is
redone without it. The design: per step, groups of ``--group`` members by a hash of (step, peer key) reduce
exactly among themselves; the owner of part j of every group sends its group's part (sum and weight) to
committee member j (``--group`` of the run's longest-lived peers); the committee closes when
``--quorum`` of the groups are in (plus a grace of a quarter of that exchange time), reduces exactly in
group order and answers; groups that failed or came late tag along (they apply the aggregate, their
samples lost). A committee member's failure fails the step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
VOLUNTEER_SESSION_S = 3600.0  # assumed mean time a volunteer stays (not measured)
STALL_S = 600.0  # a step that has not committed after this long: the run stalls


@dataclass(frozen=True)
class Inputs:
    quantile: Callable[[float], float]  # slowest-of-n0 round time at a quantile (seconds)
    n0: int
    per_member_s: float  # round time added by each further member
    kill_rate: float  # failures per peer-second (chaos test)
    refused_s: float  # time a failure costs on loopback (the port refuses)
    silent_s: float  # time a failure costs when the dead peer is silent (the part call's timeout)


def empirical_quantile(values: Sequence[float]) -> Callable[[float], float]:
    data = sorted(values)

    def q(u: float) -> float:
        pos = u * (len(data) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(data) - 1)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)

    return q


def load_round_costs(paths: Sequence[Path]) -> tuple[Callable[[float], float], int, float]:
    """The quantile function of the largest measured group, its size, and the per-member slope."""
    sizes, medians, by_size = [], [], {}
    for path in paths:
        data = json.loads(path.read_text())
        rounds = [row[2] for row in data["rounds"]]
        sizes.append(int(data["peers"]))
        medians.append(statistics.median(rounds))
        by_size[int(data["peers"])] = rounds
    if len(sizes) > 1:
        mx, my = statistics.mean(sizes), statistics.mean(medians)
        slope = sum((x - mx) * (y - my) for x, y in zip(sizes, medians, strict=True)) / sum(
            (x - mx) ** 2 for x in sizes
        )
    else:
        slope = 0.0
    n0 = max(by_size)
    return empirical_quantile(by_size[n0]), n0, max(0.0, slope)


def chaos_inputs(folder: Path) -> tuple[float, float]:
    """Kills per peer-second and the time one costs the survivors, from a chaos test's peer logs."""
    logs = []
    for path in sorted(folder.glob("peer*.jsonl")):
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        if records:
            logs.append(records)
    if not logs:
        raise SystemExit(f"--chaos: no peer*.jsonl logs in {folder}")
    last_step = max(r["step"] for records in logs for r in records if "event" not in r)
    peer_seconds = sum(records[-1]["time"] - records[0]["time"] for records in logs)
    kills = sum(
        1 for records in logs if max((r["step"] for r in records if "event" not in r), default=-1) < last_step
    )
    lost = []
    for records in logs:
        steps = [r for r in records if "event" not in r]
        gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(steps)]
        typical = statistics.median(gaps) if gaps else 0.0
        for i, r in enumerate(records):
            if r.get("event") != "round_failed":
                continue
            before = [x for x in records[:i] if "event" not in x]
            after = [x for x in records[i:] if "event" not in x]
            if before and after and after[0]["step"] == before[-1]["step"] + 1:
                lost.append(after[0]["time"] - before[-1]["time"] - typical)
    return kills / peer_seconds, statistics.median(lost) if lost else 0.0


def round_time(inp: Inputs, members: int, compute_s: float, rng: random.Random) -> float:
    u = rng.random() ** (inp.n0 / members)
    return compute_s + inp.quantile(u) + inp.per_member_s * (members - inp.n0)


def fails(rate: float, members: int, seconds: float, rng: random.Random) -> bool:
    """Whether any of ``members`` fails within ``seconds`` (each at ``rate`` per second)."""
    return rng.random() < 1.0 - math.exp(-rate * members * seconds)


@dataclass
class Outcome:
    step_s: list[float]
    attempts: int = 0
    failed: int = 0
    share: float = 0.0  # mean share of the peers whose samples count

    def line(self) -> str:
        if any(math.isinf(s) for s in self.step_s):
            return f"{'stalls':>11} {'':>8} {self.failed / max(1, self.attempts):>14.1%} {'-':>13}"
        mean, p90 = statistics.mean(self.step_s), sorted(self.step_s)[int(0.9 * len(self.step_s))]
        return f"{mean:>11.2f} {p90:>8.2f} {self.failed / max(1, self.attempts):>14.1%} {self.share:>13.1%}"


def one_group(
    inp: Inputs, n: int, rate: float, cost_s: float, compute_s: float, trials: int, seed: int
) -> Outcome:
    """Today: every alive peer in one group; any failure fails the round, which is redone."""
    rng, out = random.Random(seed), Outcome([])
    for _ in range(trials):
        spent = 0.0
        while True:
            out.attempts += 1
            t = round_time(inp, n, compute_s, rng)
            if not fails(rate, n, t, rng):
                spent += t
                break
            out.failed += 1
            spent += t + cost_s
            if spent > STALL_S:
                spent = math.inf
                break
        out.step_s.append(spent)
    out.share = 1.0
    return out


def two_level(
    inp: Inputs,
    n: int,
    rate: float,
    cost_s: float,
    compute_s: float,
    trials: int,
    seed: int,
    *,
    group: int,
    quorum: float,
) -> Outcome:
    """The design: groups of ``group`` reduce among themselves, a committee of ``group`` owners reduces
    the groups' parts and closes at a quorum of groups."""
    rng, out = random.Random(seed), Outcome([])
    groups = max(1, math.ceil(n / group))
    shares = []
    for _ in range(trials):
        spent = 0.0
        while True:
            out.attempts += 1
            arrivals = []
            for _ in range(groups):
                t1 = round_time(inp, group, compute_s, rng)
                arrivals.append(math.inf if fails(rate, group, t1, rng) else t1)
            arrivals.sort()
            need = max(1, math.ceil(quorum * groups))
            if math.isinf(arrivals[need - 1]):  # too many groups failed: the quorum is never met
                close = max(a for a in arrivals if not math.isinf(a)) if not math.isinf(arrivals[0]) else 0.0
                close += cost_s
            else:
                close = arrivals[need - 1] + 0.25 * (arrivals[need - 1] - compute_s)
            counted = sum(1 for a in arrivals if a <= close)
            # the committee's own exact round: each owner takes one call per group
            t2 = inp.quantile(rng.random() ** (inp.n0 / group)) + inp.per_member_s * (groups - inp.n0)
            t = close + max(0.0, t2)
            committee_failed = fails(rate, group, t, rng)
            if counted * 2 < groups or committee_failed:
                out.failed += 1
                spent += t + cost_s
                if spent > STALL_S:
                    spent = math.inf
                    break
                continue
            spent += t
            shares.append(counted / groups)
            break
        out.step_s.append(spent)
    out.share = statistics.mean(shares) if shares else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--round-cost", type=Path, nargs="+", required=True, help="round_cost.py --dump files"
    )
    parser.add_argument("--chaos", type=Path, default=None, help="a chaos test's peer logs (directory)")
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--compute-s", type=float, default=1.0)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--quorum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    quantile, n0, slope = load_round_costs(args.round_cost)
    swarm = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["swarm"]
    silent_s = float(swarm["allreduce_timeout_s"]) + 1.0  # the part call: the owner's wait plus a margin
    if args.chaos is not None:
        kill_rate, refused_s = chaos_inputs(args.chaos)
    else:  # measured 2026-12-04 (test_chaos on a quiet 2-core machine): 5 kills in 272 peer-seconds
        kill_rate, refused_s = 5 / 272.2, 0.25
    inp = Inputs(quantile, n0, slope, kill_rate, refused_s, silent_s)
    print(
        f"inputs: round of {n0} (median {quantile(0.5) * 1000:.1f} ms, max {quantile(1.0) * 1000:.1f} ms), "
        f"+{slope * 1000:.2f} ms per further member; compute {args.compute_s:g} s per round"
    )
    print(
        f"failures: chaos test {kill_rate:.4f}/peer-s, volunteers 1/{VOLUNTEER_SESSION_S:.0f} s (assumed); "
        f"a failure costs {refused_s:.2f} s on loopback (measured), {silent_s:.1f} s when silent (timeout)"
    )
    print(f"design: groups of {args.group}, committee of {args.group}, quorum {args.quorum:.0%} of groups\n")
    print(
        f"{'peers':>5} {'failures':<10} {'dead peer':<9} {'protocol':<10} {'mean s/step':>11} {'p90':>8} "
        f"{'failed rounds':>14} {'samples kept':>13}"
    )
    for n in (100, 1000):
        for rate_name, rate in (("chaos", kill_rate), ("volunteer", 1 / VOLUNTEER_SESSION_S)):
            for dead, cost in (("refuses", refused_s), ("silent", silent_s)):
                today = one_group(inp, n, rate, cost, args.compute_s, args.trials, args.seed)
                design = two_level(
                    inp, n, rate, cost, args.compute_s, max(1, args.trials // 4), args.seed,
                    group=args.group, quorum=args.quorum,
                )  # fmt: skip
                for name, outcome in (("one group", today), ("two-level", design)):
                    print(f"{n:>5} {rate_name:<10} {dead:<9} {name:<10} {outcome.line()}")


if __name__ == "__main__":
    main()
