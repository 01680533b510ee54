"""The task interface: a variational inequality split over devices, as the methods see it.

Knows tensors and data; knows nothing of methods, compression or networks. A task provides the initial
point, one :class:`LocalOperator` (``F_m``) per device, the projection onto the feasible set, and the
metric reported while training.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """A contiguous run of the flat vector ``z`` (one parameter tensor): its name, its length and
    whether weight decay applies to it (not to biases, norms or the adversary's tensors)."""

    name: str
    size: int
    decay: bool = True


class LocalOperator(ABC):
    """Device ``m``'s operator ``F_m`` (a gradient field for minimization, (grad_x, -grad_y) for saddles)."""

    dim: int

    @abstractmethod
    def evaluate(
        self, points: Sequence[torch.Tensor], *, step: int, full: bool = False, microbatch: int = 0
    ) -> list[torch.Tensor]:
        """``F_m`` at each point, all on the same minibatch of ``step`` (``full``: a larger one).

        Using one minibatch for all points of a step is what makes ``F_m(z') - F_m(w)`` small and
        therefore cheap to compress (MASHA.md, "Stochastic and federated variants"). ``microbatch`` j > 0
        draws the step's j-th further minibatch (members that compute more samples in a round).
        """

    @property
    def weight(self) -> float:
        """Samples behind one evaluation; aggregates may weight devices by it."""
        return 1.0

    @property
    def exact(self) -> bool:
        """Every evaluation is the whole ``F_m`` (no sampling): further microbatches repeat it and add no
        samples, so a device that evaluates more in a round still weighs one evaluation."""
        return False


class Throttled(LocalOperator):
    """``operator`` using at most ``fraction`` of this machine's time: after an evaluation that took t
    seconds it sleeps t (1 - fraction) / fraction (a volunteer's ``--throttle``, and a slow device in
    benchmarks). Results are the wrapped operator's, bit for bit."""

    def __init__(self, operator: LocalOperator, fraction: float) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"throttle fraction must be in (0, 1], not {fraction}")
        self.operator, self.fraction, self.dim = operator, float(fraction), operator.dim

    def evaluate(
        self, points: Sequence[torch.Tensor], *, step: int, full: bool = False, microbatch: int = 0
    ) -> list[torch.Tensor]:
        start = time.monotonic()
        out = self.operator.evaluate(points, step=step, full=full, microbatch=microbatch)
        if self.fraction < 1:
            time.sleep((time.monotonic() - start) * (1 - self.fraction) / self.fraction)
        return out

    @property
    def weight(self) -> float:
        return self.operator.weight

    @property
    def exact(self) -> bool:
        return self.operator.exact

    def __getattr__(self, name: str) -> object:  # the wrapped operator's extras (e.g. last_loss)
        return getattr(self.__dict__["operator"], name)


class Task(ABC):
    """A VI ``find z*: <F(z*), z - z*> >= 0`` with ``F = (1/M) sum_m F_m``."""

    dim: int
    metric_name: str = "metric"

    @abstractmethod
    def initial_point(self) -> torch.Tensor:
        """``z^0`` (float32, 1-D), the same for every device."""

    @abstractmethod
    def local_operator(self, index: int) -> LocalOperator:
        """The operator of device ``index``."""

    def project(self, z: torch.Tensor) -> torch.Tensor:
        """Euclidean projection onto the feasible set (identity when unconstrained)."""
        return z

    def segments(self) -> list[Segment]:
        """The layout of ``z`` into named tensors (optimizers decay and scale per segment)."""
        return [Segment("z", self.dim, decay=True)]

    @abstractmethod
    def metric(self, z: torch.Tensor) -> float:
        """The progress figure (lower is better) reported for ``z``."""
