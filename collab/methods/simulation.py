"""Run a method in one process over M simulated devices and record its trajectory.

Knows configs, tasks and methods; no networking and no terminal output (callers pass ``on_step``).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collab.config import MethodConfig, RunConfig
from collab.methods.base import MethodState, StepReport
from collab.methods.build import build_method
from collab.methods.simulated import SimulatedAggregator
from collab.tasks.build import build_task


@dataclass
class SimulationResult:
    """Trajectory and totals of one simulated run. Bits are per device (the paper's "bits sent")."""

    method: str
    label: str
    device_compressor: str
    ratio: float
    gamma: float
    tau: float | None
    steps: int
    final_metric: float
    bits_per_device: float
    bits_down_per_device: float
    bits_to_target: float | None
    steps_to_target: int | None
    state_hash: str
    metric_name: str = "rel_distance"
    rows: list[tuple[int, float, float, float]] = field(default_factory=list)  # step, up, down, metric
    final_state: MethodState | None = field(default=None, repr=False, compare=False)

    def summary(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "label": self.label,
            "device_compressor": self.device_compressor,
            "ratio": self.ratio,
            "gamma": self.gamma,
            "tau": self.tau,
            "steps": self.steps,
            "final_rel_distance": self.final_metric,  # the bilinear metric's name; see metric_name
            "final_metric": self.final_metric,
            "metric_name": self.metric_name,
            "bits_per_device": self.bits_per_device,
            "bits_down_per_device": self.bits_down_per_device,
            "bits_to_target": self.bits_to_target,
            "steps_to_target": self.steps_to_target,
            "state_hash": self.state_hash,
        }


def simulate(
    cfg: RunConfig,
    *,
    method: MethodConfig | None = None,
    stop_at_target: bool = True,
    on_step: Callable[[StepReport, float], None] | None = None,
) -> SimulationResult:
    """Run ``method`` (default ``cfg.method``) for up to ``cfg.max_steps`` steps on ``cfg.num_devices``."""
    mc = method or cfg.method
    task = build_task(cfg)
    agg = SimulatedAggregator.for_run(cfg)
    algo = build_method(cfg, task, agg, range(cfg.num_devices), method=mc)
    algo.initialize()
    metric = task.metric(algo.z)
    rows = [(0, agg.stats.bits_up, agg.stats.bits_down, metric)]
    bits_to_target: float | None = None
    steps_to_target: int | None = None
    for _ in range(cfg.max_steps):
        report = algo.step()
        metric = task.metric(algo.z)
        rows.append((report.step, agg.stats.bits_up, agg.stats.bits_down, metric))
        if on_step is not None:
            on_step(report, metric)
        if not math.isfinite(metric):
            break
        if bits_to_target is None and metric <= cfg.target_rel_distance:
            bits_to_target, steps_to_target = agg.stats.bits_up, report.step
            if stop_at_target:
                break
    assert algo.state is not None
    return SimulationResult(
        method=mc.name,
        label=method_label(mc),
        device_compressor=mc.device_compressor.name,
        ratio=mc.device_compressor.ratio if mc.device_compressor.name != "identity" else 1.0,
        gamma=mc.gamma,
        tau=getattr(algo, "tau", None),
        steps=algo.state.step,
        final_metric=metric,
        bits_per_device=agg.stats.bits_up,
        bits_down_per_device=agg.stats.bits_down,
        bits_to_target=bits_to_target,
        steps_to_target=steps_to_target,
        state_hash=algo.state.hash(),
        metric_name=task.metric_name,
        rows=rows,
        final_state=algo.state,
    )


def write_metrics_csv(path: str | Path, results: list[SimulationResult]) -> None:
    """One CSV row per recorded step: method, label, step, bits (up, down) per device, rel_distance."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["method", "label", "step", "bits_per_device", "bits_down_per_device", "rel_distance"])
        for res in results:
            for step, up, down, metric in res.rows:
                out.writerow([res.method, res.label, step, f"{up:.0f}", f"{down:.0f}", f"{metric:.6e}"])


def default_comparison(cfg: RunConfig) -> list[MethodConfig]:
    """The methods ``--compare`` runs: ``cfg.compare`` if given, else the configured method alone."""
    return list(cfg.compare) or [cfg.method]


def method_label(mc: MethodConfig) -> str:
    """A short human name: ``masha1 randk 0.2`` (``per-device`` when coordinates are independent)."""
    dev = mc.device_compressor
    if dev.name == "identity":
        return mc.name
    extra = " per-device" if dev.name == "randk" and dev.coordinates == "per_device" else ""
    return f"{mc.name} {dev.name} {dev.ratio:g}{extra}"
