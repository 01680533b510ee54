"""Glue: build a task from its config section."""

from __future__ import annotations

from collections.abc import Callable

from collab.config import RunConfig
from collab.tasks.base import Task
from collab.tasks.bilinear import BilinearTask


def build_task(
    cfg: RunConfig,
    *,
    num_devices: int | None = None,
    device: str = "cpu",
    precision: str = "fp32",
    batch_size: int | None = None,
) -> Task:
    """The task of ``cfg`` split over ``num_devices`` (default ``cfg.num_devices``) shards; operators
    evaluate on ``device`` under ``precision`` autocast (tasks without tensors to move ignore both).
    ``batch_size`` overrides the config's (a volunteer's local choice)."""
    t = cfg.task
    m = num_devices or cfg.num_devices
    if t.name == "bilinear":
        return BilinearTask(
            dim=t.dim,
            num_devices=m,
            reg_lambda=t.reg_lambda,
            seed=cfg.seed,
            heterogeneity=t.heterogeneity,
            init_scale=t.init_scale,
        )
    from collab.tasks.torch_task import TorchProblem, TorchTask

    factory: str | Callable[..., TorchProblem]
    if t.name == "adversarial":
        from collab.tasks.adversarial import adversarial_mlm

        factory, options = adversarial_mlm, t.model_dump(exclude={"name", "batch_size"})
    elif t.name == "text2image":
        from collab.tasks.text2image import text2image

        factory, options = text2image, t.model_dump(exclude={"name", "batch_size", "prompts"})
    else:
        factory, options = t.factory, t.options
    return TorchTask(
        factory=factory,
        options=options,
        num_devices=m,
        seed=cfg.seed,
        batch_size=batch_size or t.batch_size,
        device=device,
        precision=precision,
    )
