"""Glue: map a RunConfig's method section onto a method object (the one place that reads the config)."""

from __future__ import annotations

from collections.abc import Sequence

from collab.compression import make_compressor
from collab.config import MethodConfig, RunConfig
from collab.methods.base import Aggregator, Method, Worker
from collab.methods.extragradient import ExtraGradient
from collab.methods.masha import MASHA1, MASHA2
from collab.methods.optimizers import Schedule, UpdateRule
from collab.rng import derived_seed
from collab.tasks.base import Task


def build_method(
    cfg: RunConfig,
    task: Task,
    aggregator: Aggregator,
    device_indices: Sequence[int],
    method: MethodConfig | None = None,
    device_keys: Sequence[str] | None = None,
) -> Method:
    """The configured method for the local devices ``device_indices`` of ``task``.

    ``device_keys`` name the devices for per-device compressor seeds (default: their indices).
    """
    mc = method or cfg.method
    dev = mc.device_compressor
    per_device = dev.name == "randk" and dev.coordinates == "per_device"
    workers = [
        Worker(
            task.local_operator(i),
            make_compressor(dev.name, dev.ratio),
            compress_seed=derived_seed(cfg.seed, f"device:{device_keys[n] if device_keys else i}")
            if per_device
            else None,
        )
        for n, i in enumerate(device_indices)
    ]
    common = dict(
        z0=task.initial_point(),
        workers=workers,
        aggregator=aggregator,
        gamma=mc.gamma,
        seed=cfg.seed,
        optimizer=build_update_rule(mc, task, max_steps=cfg.max_steps),
    )
    if mc.name == "extragradient":
        return ExtraGradient(project=task.project, **common)  # type: ignore[arg-type]
    cls = MASHA1 if mc.name == "masha1" else MASHA2
    return cls(
        tau=mc.effective_tau(task.dim),
        anchor=mc.anchor,
        server_compressor=make_compressor(mc.server_compressor.name, mc.server_compressor.ratio),
        project=task.project,
        **common,  # type: ignore[arg-type]
    )


def build_update_rule(mc: MethodConfig, task: Task, *, max_steps: int) -> UpdateRule:
    """The update rule of ``mc.optimizer`` over ``task``'s parameter layout."""
    oc = mc.optimizer
    sched = oc.schedule
    return UpdateRule(
        name=oc.name,
        gamma=mc.gamma,
        schedule=Schedule(
            kind=sched.name,
            warmup_steps=sched.warmup_steps,
            total_steps=sched.total_steps or max_steps,
            min_ratio=sched.min_ratio,
        ),
        beta1=oc.beta1,
        beta2=oc.beta2,
        eps=oc.eps,
        weight_decay=oc.weight_decay,
        clip_norm=oc.clip_norm,
        segments=task.segments(),
    )
