"""Microbatches per round (collab/methods/base.py) and the throttle (collab/tasks/base.py), against plain
reference code: several microbatches give their mean with weight = samples, both MASHA points on the same
microbatches; one microbatch is bit for bit the step of old."""

from __future__ import annotations

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
    RoundKey,
    ServerFn,
    TimeBudget,
    Worker,
)
from collab.methods.build import build_method
from collab.methods.simulated import SimulatedAggregator
from collab.tasks.base import Throttled
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


def test_three_microbatches_contribute_their_mean_with_three_times_the_weight() -> None:
    cfg = _tiny_text2image()
    task = build_task(cfg)
    agg = Recording()
    method = build_method(cfg, task, agg, [0])
    method.initialize()
    assert method.state is not None
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
