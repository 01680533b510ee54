"""Tasks: operators F_m, their data and metrics (pure math; never imports networking)."""

from collab.tasks.base import LocalOperator, Segment, Task
from collab.tasks.bilinear import BilinearTask
from collab.tasks.torch_task import FactoryError, TorchProblem, TorchTask, task_factory

__all__ = [
    "BilinearTask",
    "FactoryError",
    "LocalOperator",
    "Segment",
    "Task",
    "TorchProblem",
    "TorchTask",
    "task_factory",
]
