"""Glue: build a task from its config section."""

from __future__ import annotations

from collab.config import RunConfig
from collab.tasks.base import Task
from collab.tasks.bilinear import BilinearTask


def build_task(cfg: RunConfig, *, num_devices: int | None = None, device: str = "cpu") -> Task:
    """The task of ``cfg`` split over ``num_devices`` (default ``cfg.num_devices``) shards; operators
    evaluate on ``device`` (tasks without tensors to move ignore it)."""
    t = cfg.task
    m = num_devices or cfg.num_devices
    if t.name == "adversarial":
        from collab.tasks.adversarial import AdversarialTask

        return AdversarialTask(
            num_devices=m,
            seed=cfg.seed,
            seq_len=t.seq_len,
            batch_size=t.batch_size,
            embedding_size=t.embedding_size,
            hidden_size=t.hidden_size,
            layers=t.layers,
            heads=t.heads,
            epsilon=t.epsilon,
            mask_prob=t.mask_prob,
            device=device,
        )
    if t.name == "bilinear":
        return BilinearTask(
            dim=t.dim,
            num_devices=m,
            reg_lambda=t.reg_lambda,
            seed=cfg.seed,
            heterogeneity=t.heterogeneity,
            init_scale=t.init_scale,
        )
    raise ValueError(f"unknown task {t.name!r}")
