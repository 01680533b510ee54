"""Tasks: operators F_m, their data and metrics (pure math; never imports networking)."""

from collab.tasks.base import LocalOperator, Task
from collab.tasks.bilinear import BilinearTask

__all__ = ["BilinearTask", "LocalOperator", "Task"]
