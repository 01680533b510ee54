"""Microbatches per round (collab/methods/base.py) and the throttle (collab/tasks/base.py), against plain
reference code: several microbatches give their mean with weight = samples, both MASHA points on the same
microbatches; one microbatch is bit for bit the step of old."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch

from collab.compression import CompressedMessage, Identity, TopK
from collab.config import load_config, with_overrides
from collab.methods import MASHA2
from collab.methods.base import (
    Aggregator,
    CommStats,
    Contribution,
    FixedMicrobatches,
    RoundFailed,
    RoundKey,
    ServerFn,
    TimeBudget,
    Worker,
)
from collab.methods.build import build_method
from collab.methods.simulated import SimulatedAggregator
from collab.tasks.base import LocalOperator, Throttled
from collab.tasks.build import build_task
from tests.conftest import CONFIGS


class Recording(Aggregator):
    """One local device; remembers what it was asked to average (the reference reads it)."""

    def __init__(self) -> None:
        self.stats = CommStats()
        self.seen: list[tuple[RoundKey, float, torch.Tensor]] = []

    @property
    def num_local(self) -> int:
        return 1

    def reduce(
        self, key: RoundKey, contributions: Sequence[Contribution], server: ServerFn
    ) -> CompressedMessage:
        c = contributions[0]
        self.seen.append((key, c.weight, c.message.decompress()))
        return server(c.message)


def _tiny_text2image():  # type: ignore[no-untyped-def]
    cfg = load_config(CONFIGS / "text2image.yaml")
    task_cfg = {"layers": 1, "hidden": 16, "heads": 2, "train_scenes": 60, "eval_scenes": 4, "batch_size": 4}
    return with_overrides(cfg, num_devices=2, task=task_cfg)


def _recorded_method():  # type: ignore[no-untyped-def]
    """The tiny config's device 0, initialized, over a :class:`Recording` aggregator."""
    cfg = _tiny_text2image()
    task = build_task(cfg)
    agg = Recording()
    method = build_method(cfg, task, agg, [0])
    method.initialize()
    assert method.state is not None
    return cfg, task, agg, method


def test_three_microbatches_contribute_their_mean_with_three_times_the_weight() -> None:
    cfg, task, agg, method = _recorded_method()
    state = method.state.clone()
    method.microbatches = FixedMicrobatches(3)
    method.step()
    key, weight, sent = agg.seen[-1] if agg.seen[-1][0].phase == "delta" else agg.seen[-2]
    assert key == RoundKey(0, "delta") and weight == 3 * 4
    # reference: the same points, microbatches 0, 1, 2 of step 0, both points on each
    op = task.local_operator(0)
    zbar = method.tau * state.z + (1 - method.tau) * state.w  # type: ignore[attr-defined]
    plan = method.optimizer.plan(state.extra, 0, zbar)
    z_half = plan.extrapolate(state.fw)
    halves, refs = [], []
    for j in range(3):
        f_half, f_w = op.evaluate([z_half, state.w], step=0, microbatch=j)
        halves.append(f_half)
        refs.append(f_w)
    # each point's mean over the microbatches (summed in microbatch order), then their difference
    mean = (halves[0] + halves[1] + halves[2]) / 3 - (refs[0] + refs[1] + refs[2]) / 3
    target = torch.zeros_like(mean) + mean  # MASHA2: error feedback (zero at the start) + delta
    expected = (
        TopK(ratio=cfg.method.device_compressor.ratio).compress(target, seed=cfg.seed, step=0).decompress()
    )
    assert torch.equal(sent, expected)
    assert method.last_samples == 12


def test_an_exact_operator_weighs_one_evaluation_however_often_it_repeats() -> None:
    """The bilinear operator has no sampling: five microbatches are five repeats. The device sends what one
    evaluation gives, bit for bit, with one evaluation's weight: a fast machine repeating its shard more
    often must not weigh it more (the problem's operator is the mean over shards)."""
    cfg = load_config(CONFIGS / "demo.yaml")
    sent = []
    for plan in (FixedMicrobatches(1), FixedMicrobatches(5)):
        task = build_task(cfg)
        assert task.local_operator(0).exact and Throttled(task.local_operator(0), 0.5).exact
        agg = Recording()
        method = build_method(cfg, task, agg, [0])
        method.microbatches = plan
        method.step()
        delta = [(w, m) for key, w, m in agg.seen if key.phase == "delta"]
        sent.append(delta[0])
        assert method.last_samples == 1
    assert sent[0][0] == sent[1][0] == 1.0
    assert torch.equal(sent[0][1], sent[1][1])


def test_one_microbatch_is_the_step_of_old_bit_for_bit() -> None:
    cfg = with_overrides(_tiny_text2image(), num_devices=1)
    runs = []
    for plan in (None, FixedMicrobatches(1), TimeBudget(0.0)):
        task = build_task(cfg)
        method = build_method(cfg, task, SimulatedAggregator(num_devices=1), [0])
        if plan is not None:
            method.microbatches = plan
        for _ in range(3):
            method.step()
        assert method.state is not None
        runs.append(method.state.hash())
    assert len(set(runs)) == 1


def test_time_budget_stops_before_the_next_microbatch_would_overrun() -> None:
    budget = TimeBudget(1.0)
    assert budget.more(0, 5.0), "the first microbatch is always evaluated"
    assert budget.more(1, 0.4) and not budget.more(1, 0.6)  # 0.4 + 0.4 fits, 0.6 + 0.6 does not
    assert budget.more(3, 0.75) and not budget.more(4, 0.9)


def test_throttled_operator_returns_the_same_tensors() -> None:
    cfg = _tiny_text2image()
    task = build_task(cfg)
    op = task.local_operator(1)
    z = task.initial_point()
    plain = op.evaluate([z], step=2, microbatch=1)[0]
    slow = Throttled(task.local_operator(1), 0.5)
    assert torch.equal(slow.evaluate([z], step=2, microbatch=1)[0], plain)
    assert slow.weight == op.weight and slow.dim == op.dim
    assert slow.last_loss == slow.operator.last_loss  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        Throttled(op, 0.0)


def test_masha_worker_loop_uses_each_workers_own_count() -> None:
    """Two local devices with the same plan: each contributes its own microbatches (simulation-style)."""
    cfg = _tiny_text2image()
    task = build_task(cfg)
    workers = [Worker(task.local_operator(i), Identity()) for i in range(2)]
    method = MASHA2(
        z0=task.initial_point(), workers=workers, aggregator=SimulatedAggregator(num_devices=2),
        gamma=0.01, tau=0.5, seed=0,
    )  # fmt: skip
    method.microbatches = FixedMicrobatches(2)
    method.step()
    assert method.last_samples == 2 * 2 * 4


class _Slow(LocalOperator):
    """An operator that takes ``seconds`` per evaluation (a device far slower than the round)."""

    def __init__(self, operator: LocalOperator, seconds: float) -> None:
        self.operator, self.seconds, self.dim = operator, seconds, operator.dim
        self.calls = 0

    def evaluate(
        self, points: Sequence[torch.Tensor], *, step: int, full: bool = False, microbatch: int = 0
    ) -> list[torch.Tensor]:
        self.calls += 1
        time.sleep(self.seconds)
        return self.operator.evaluate(points, step=step, full=full, microbatch=microbatch)

    @property
    def weight(self) -> float:
        return self.operator.weight


def test_a_device_too_slow_for_the_round_tags_along_with_weight_zero() -> None:
    _, _, agg, method = _recorded_method()
    before = method.workers[0].error
    assert before is not None
    before = before.clone()
    slow = _Slow(method.workers[0].operator, 0.5)
    method.workers[0].operator = slow
    method.microbatches = TimeBudget(0.01, deadline_s=0.05)
    start = time.monotonic()
    method.step()
    assert time.monotonic() - start < 0.45, "the step must not wait for the slow evaluation"
    delta = [(w, sent) for key, w, sent in agg.seen if key.phase == "delta"]
    weight, sent = delta[-1]
    assert weight == 0 and not torch.any(sent), "a tag-along sends an empty message with weight 0"
    assert torch.equal(method.workers[0].error, before), "its residual waits for a later round"
    assert method.last_samples == 0
    # the next round waits for the dropped evaluation first (a device computes one thing at a time);
    # with time to spare it contributes again
    method.microbatches = TimeBudget(0.01, deadline_s=5.0)
    method.step()
    assert slow.calls >= 2
    weight, _ = [(w, s) for key, w, s in agg.seen if key.phase == "delta"][-1]
    assert weight > 0


class _LosesAt(Recording):
    """Fails the delta round of ``step`` after the contribution 'left' (a group id is attempted)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.lose_step = step

    def reduce(
        self, key: RoundKey, contributions: Sequence[Contribution], server: ServerFn
    ) -> CompressedMessage:
        self.last_attempt = f"group-{key}"
        if key == RoundKey(self.lose_step, "delta"):
            raise RoundFailed("answers lost")
        return super().reduce(key, contributions, server)


def test_a_member_that_lost_a_committed_round_takes_the_residual_that_goes_with_it() -> None:
    cfg = _tiny_text2image()
    runs = []
    for agg in (Recording(), _LosesAt(2), _LosesAt(2)):
        method = build_method(cfg, build_task(cfg), agg, [0])
        for _ in range(2):
            method.step()
        runs.append(method)
    good, other_group, same_group = runs
    for lossy in (other_group, same_group):
        with pytest.raises(RoundFailed):
            lossy.step()
        assert lossy.pending_rounds == ["group-2:delta"]
    kept = other_group.workers[0].error.clone()  # type: ignore[union-attr]
    good.step()  # what the group committed at step 2, with the lossy member's contribution
    assert good.state is not None
    assert not torch.equal(good.workers[0].error, kept), "step 2 moved the residual"  # type: ignore[arg-type]

    other_group.adopt_state(good.state, used=["group-9:delta"])  # the source: not with our contribution
    assert torch.equal(other_group.workers[0].error, kept), "a residual never sent stays"  # type: ignore[arg-type]
    same_group.adopt_state(good.state, used=["group-2:delta"])  # the source: committed with it
    assert torch.equal(same_group.workers[0].error, good.workers[0].error)  # type: ignore[arg-type]
    assert same_group.state is not None and same_group.state.hash() == good.state.hash()
    assert same_group.pending_rounds == [] and other_group.pending_rounds == []


# published rates: "c" publishes garbage (read as no rate), "d" nothing
RATES: dict[str, dict[str, object]] = {
    "a": {"rate": 100.0},
    "b": {"rate": 300.0},
    "c": {"rate": "fast"},
    "d": {},
}


def test_target_batch_budget_follows_the_groups_published_rates() -> None:
    from collab.config import SwarmConfig
    from collab.swarm.budget import RoundBudget, group_rate
    from collab.swarm.records import parse_alive
    from collab.swarm.timing import Timing

    alive = parse_alive({p: {"step": 1, "status": "training", **v} for p, v in RATES.items()})
    assert group_rate(["a", "b"], alive) == 400.0
    assert group_rate(["a", "b", "c"], alive) == 600.0, "unknown rates count at the others' median"
    assert group_rate(["c", "d"], alive) is None
    sw = SwarmConfig(round_time_s=2.0, target_batch_size=200)
    members = ["a", "b"]
    budget = RoundBudget(
        round_time_s=2.0,
        target_batch_size=200,
        timing=Timing.of(sw),
        members=lambda: members,
        alive=lambda: alive,
    )
    assert budget.seconds() == 0.5  # 200 samples at 400 samples/s
    assert budget.more(0, 9.0) and budget.more(1, 0.2) and not budget.more(1, 0.3)
    members = ["c", "d"]
    assert budget.seconds() == 2.0, "no rate known yet: the round budget"
    members = ["a"]
    assert budget.seconds() == 2.0, "a slow group is capped by round_time_s"
    assert budget.deadline_s == Timing.of(sw).tag_along_s == 4.0
    with pytest.raises(ValueError, match="target_batch_size needs round_time_s"):
        SwarmConfig(target_batch_size=64)


def test_timing_derives_every_wait_from_the_swarm_settings() -> None:
    from collab.config import SwarmConfig
    from collab.swarm.timing import Timing

    t = Timing.of(SwarmConfig(matchmaking_timeout_s=4.0, allreduce_timeout_s=6.0, round_time_s=5.0))
    assert t.patience_s == 60.0 and t.stall_s == 100.0
    assert t.part_call_s > t.allreduce_s and t.reduce_wait_s > t.part_call_s
    assert t.matchmaking_wait_s > t.matchmaking_s
    assert t.tag_along_s == 8.0, "one more budget, at most half the exchange limit"
    assert Timing.of(SwarmConfig()).tag_along_s is None


def test_config_guard_follows_the_coordinator_else_the_majority() -> None:
    from collab.swarm.config_guard import ConfigGuard, ConfigMismatch
    from collab.swarm.records import AliveRecord, PeerStatus, parse_alive

    guard = ConfigGuard("me", "v1")
    v1, v2 = (AliveRecord(step=3, status=PeerStatus.TRAINING, version=v) for v in ("v1", "v2"))
    coordinator = {v: AliveRecord(step=-1, status=PeerStatus.COORDINATOR, version=v) for v in ("v1", "v2")}
    guard.check({"me": v1, "a": v2})  # a tie keeps this peer running
    with pytest.raises(ConfigMismatch, match=r"version v1.*version v2"):
        guard.check({"a": v2, "b": v2, "d": v2, "c": v1})
    guard.check({"a": v2, "b": v2, "c": v1})  # 2 against 2 (with this peer)
    guard.check({"a": v2, "b": v2, "k": coordinator["v1"]})
    with pytest.raises(ConfigMismatch):
        guard.check({"k": coordinator["v2"], "c": v1})
    # records without a usable version say nothing (malformed ones are not even counted alive)
    raw = {"a": {"step": 1, "status": "training"}, "b": {"step": 1, "status": "training", "version": 7}}
    assert list(parse_alive(raw)) == ["a"]
    guard.check(parse_alive(raw))


def test_claim_bounds_follow_each_members_published_device() -> None:
    from collab.config import SwarmConfig
    from collab.swarm.budget import CLAIM_SLACK, ClaimBounds, group_rate
    from collab.swarm.records import parse_alive

    published = {
        "slow": {"rate": 10.0, "microbatch": 8},
        "fast": {"rate": 400.0, "microbatch": 32},  # an honest GPU: 40x the slow one
        "mid": {"rate": 20.0, "microbatch": 8},
        "liar": {"rate": 1e9, "microbatch": 1e9},  # inflated numbers: capped at 100x the lower median
        "new": {"microbatch": 8, "rate": None},  # no rate yet
    }
    alive = parse_alive({p: {"step": 9, "status": "training", **v} for p, v in published.items()})
    lockstep = ClaimBounds(SwarmConfig(), alive=lambda: alive)
    assert lockstep(["slow", "fast", "mid"]) == {"slow": 8, "fast": 32, "mid": 8}, "one microbatch each"
    assert lockstep(["slow", "nobody"]) == {"slow": 8}, "no record: left to the group-median check"

    timed = ClaimBounds(SwarmConfig(round_time_s=0.5), alive=lambda: alive)
    got = timed(["slow", "fast", "mid", "new"])
    assert got == {
        "slow": 8 + CLAIM_SLACK * 10 * 0.5,
        "fast": 32 + CLAIM_SLACK * 400 * 0.5,
        "mid": 8 + CLAIM_SLACK * 20 * 0.5,
    }
    capped = timed(["slow", "mid", "liar"])
    assert capped["liar"] == 100 * 8 + CLAIM_SLACK * 100 * 20 * 0.5, "capped at 100x the lower medians"
    assert group_rate(["slow", "mid", "liar"], alive, ratio=100.0) == 10 + 20 + 2000

    # with a target batch the budget is the group's: 90 samples at 30 samples/s of slow + mid = 3 s
    target = ClaimBounds(SwarmConfig(round_time_s=5.0, target_batch_size=90), alive=lambda: alive)
    assert target(["slow", "mid"]) == {"slow": 8 + CLAIM_SLACK * 10 * 3.0, "mid": 8 + CLAIM_SLACK * 20 * 3.0}


def test_settle_bans_leaves_out_the_accused_only_on_a_majority() -> None:
    from collab.swarm.matchmaking import settle_bans

    group = ["a", "b", "c", "d"]
    assert settle_bans(group, {}, keep="a") == set()
    # one peer bans a member: alone it cannot shut that member out, so it leaves itself
    assert settle_bans(group, {"d": {"c"}}, keep="a") == {"d"}
    # three of four ban the same member: it stays out
    assert settle_bans(group, {"b": {"d"}, "c": {"d"}, "a": {"d"}}, keep="a") == {"d"}
    # a peer that bans everyone shuts out only itself; the leader always stays
    assert settle_bans(group, {"d": {"a", "b", "c"}}, keep="a") == {"d"}
    assert settle_bans(group, {"b": {"a"}, "c": {"a"}, "d": {"a"}}, keep="a") == {"b", "c", "d"}
    # a tie: the accusers go, unless the group would then be too small for a round and without the
    # accused it would not (a leader that never saw an attacker's parts, two honest joiners that ban it)
    assert settle_bans(group, {"b": {"d"}, "c": {"d"}}, keep="a") == {"b", "c"}
    assert settle_bans(group, {"b": {"d"}, "c": {"d"}}, keep="a", min_size=3) == {"d"}
    assert settle_bans(group, {"b": {"d"}, "c": {"d"}}, keep="a", min_size=4) == {"b", "c"}  # fails anyway
    # one at a time, the most accused first: the attackers that ban one another go before the tie is
    # settled (the group of a CI failure: leader L, honest H1 H2 banning X Y Z, attackers banning one another)
    attackers = {"X", "Y", "Z"}
    avoids = {"H1": attackers, "H2": attackers, "X": {"Y"}, "Y": {"X"}, "Z": {"X", "Y"}}
    assert settle_bans(["L", "H1", "H2", "X", "Y", "Z"], avoids, keep="L", min_size=3) == attackers
    # the leader's own ban is final
    assert settle_bans(group, {"a": {"b"}}, keep="a") == {"b"}
    # a minority cannot shrink the group to win a count (found on review): S is caught by four honest
    # peers, S and two more attackers ban the honest H; judged among the members left once S's accusers
    # went, H's three accusers would be a majority of five. Only accused members leave by count.
    members = ["K", "H", "W", "X", "Y", "Z", "A1", "A2", "S"]
    plot = {p: {"S"} for p in "WXYZ"} | {"A1": {"H"}, "A2": {"H"}, "S": {"H"}}
    assert settle_bans(members, plot, keep="K") == {"A1", "A2", "S"}
    assert settle_bans(members, plot, keep="K", min_size=4) == {"A1", "A2", "S"}


def test_alive_records_name_their_bans_and_order_leaders() -> None:
    from collab.swarm.records import MAX_PUBLISHED_BANS, AliveRecord, PeerStatus, parse_alive

    rec = AliveRecord(step=2, status=PeerStatus.TRAINING, bans=("x", "y"))
    assert AliveRecord.parse(rec.to_wire()) == rec
    many = AliveRecord(step=2, status=PeerStatus.TRAINING, bans=tuple(f"p{i}" for i in range(100)))
    assert len(AliveRecord.parse(many.to_wire()).bans) == MAX_PUBLISHED_BANS  # type: ignore[union-attr]
    for bad in ("x", ["x", 3], None):
        assert AliveRecord.parse({"step": 1, "status": "training", "bans": bad}) is None, bad
    assert AliveRecord.parse({"step": 1, "status": "training"}).bans == ()  # type: ignore[union-attr]
    # the order matchmaking uses: fewest records banning a peer, then its key; a self-ban counts nothing
    from collab.swarm.matchmaking import leader_order

    view = parse_alive(
        {
            "a": {"step": 1, "status": "training", "bans": ["a", "b"]},
            "b": {"step": 1, "status": "training"},
            "c": {"step": 1, "status": "training", "bans": ["a"]},
            "d": {"step": 1, "status": "training", "bans": ["b"]},
        }
    )
    order = leader_order(view)
    assert sorted(["d", "c", "b", "a"], key=order) == ["c", "d", "a", "b"]
    assert order("unknown") == (0, "unknown")


def test_exchange_waits_grow_with_the_payload_at_the_slower_link() -> None:
    from collab.config import SwarmConfig
    from collab.swarm.timing import EXCHANGE_TRAFFIC, Timing

    t = Timing.of(SwarmConfig(allreduce_timeout_s=6.0, min_bandwidth_mb_s=10.0))
    assert t.for_payload(0) == t  # small rounds keep the configured limits
    big = t.for_payload(100_000_000)  # 100 MB per member at 10 MB/s
    extra = EXCHANGE_TRAFFIC * 10.0
    assert big.allreduce_s == pytest.approx(t.allreduce_s + extra)
    assert big.part_call_s == pytest.approx(t.part_call_s + extra)
    assert big.reduce_wait_s == pytest.approx(t.reduce_wait_s + extra)
    assert big.matchmaking_s == t.matchmaking_s  # forming a group does not move bytes
    # a measured link slower than the configured one stretches the waits; a faster one never shortens them
    assert t.for_payload(100_000_000, measured_b_s=5e6).allreduce_s == pytest.approx(
        t.allreduce_s + 2 * extra
    )
    assert t.for_payload(100_000_000, measured_b_s=1e9) == big
