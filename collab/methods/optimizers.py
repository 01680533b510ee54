"""Update rules applied to the group's aggregate direction: SGD (the paper's step), Adam, AdamW, LAMB.

Knows flat float32 tensors, a step-keyed stepsize schedule and the layout of the flat vector into
segments (one per parameter tensor); knows nothing of tasks, compression or networks. Every member of a
group calls the same rule on the same aggregate with the same replicated moments, so the result (and the
new moments, which live in :class:`~collab.methods.base.MethodState`) is identical bit for bit.

One step ``k`` of an extragradient-family method has two moves from the same anchor ``zbar``: the
extrapolation along ``d0`` (MASHA: ``F(w^k)``; extragradient: ``F(z^k)``) and the update along
``d1`` (MASHA: ``F(w^k) + g``; extragradient: ``F(z_half)``). Following Extra-Adam (Gidel et al., "A
Variational Inequality Perspective on Generative Adversarial Networks", ICLR 2019), both moves are
Adam-type steps from the *same* stored moments ``(m_k, v_k)``, and both use the preconditioner ``D_k``
fixed at the extrapolation - the update never a smaller one than plain Adam would use for its own
direction. Without that guard a coordinate where ``d1`` is far larger than ``d0`` (MASHA: the group's
``g`` against a near-zero entry of ``F(w)``) moves by ``lr * |d1| / |d0|``: seen as a 15x jump of the
distance to the solution in one step of a 4-peer run, and in 1 of ~150 simulated runs with uneven sample
weights (``bench``-free reproduction in ``tests/unit/test_optimizers.py``)::

    t = k + 1, lr = gamma * schedule(k)
    d   <- clip(d)                                       (aggregate norm clipped to clip_norm, if set)
    extrapolation: m' = b1 m_k + (1-b1) d0;  v' = b2 v_k + (1-b2) d0^2
                   D_k = sqrt(v' / (1 - b2^t)) + eps              (the step's preconditioner)
                   u0  = (m' / (1 - b1^t)) / D_k
    update:        m_{k+1} = b1 m_k + (1-b1) d1;  v_{k+1} = b2 v_k + (1-b2) d1^2
                   u1  = (m_{k+1} / (1 - b1^t)) / max(D_k, sqrt(v_{k+1} / (1 - b2^t)) + eps)
    move:          z = proj(zbar - lr * u)
    weight decay:  adamw, lamb: u += wd * zbar (decoupled); adam, sgd: d += wd * zbar (an L2 penalty)

LAMB (You et al., 2020) multiplies ``u + wd * zbar`` of each segment by its trust ratio
``||zbar_s|| / ||u_s + wd zbar_s||`` (1 when either norm is 0, at most 10); the ratios are computed once
at the extrapolation and reused for the update (part of the step's preconditioner). SGD is the paper's
update, ``u = d`` (plus ``wd * zbar`` when weight decay is set), bit for bit the expression the methods
used before rules existed. ``docs/ALGORITHMS.md`` says which of MASHA's guarantees survive which rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from collab.tasks.base import Segment

MOMENT_M, MOMENT_V = "opt_m", "opt_v"
MAX_TRUST_RATIO = 10.0


@dataclass(frozen=True)
class Schedule:
    """``gamma * factor(step)``: linear warmup over ``warmup_steps``, then constant, cosine or linear
    decay to ``min_ratio`` at ``total_steps``. A pure function of the step (peers need no shared clock)."""

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    min_ratio: float = 0.0

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / span))
        if self.kind == "cosine":
            return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.kind == "linear":
            return 1.0 - (1.0 - self.min_ratio) * progress
        raise ValueError(f"unknown schedule {self.kind!r}")


class StepPlan:
    """The two moves of one step, sharing the step's stepsize and preconditioner.

    Created by :meth:`UpdateRule.plan`; :meth:`extrapolate` gives the first point, :meth:`update` the
    next iterate and the new moments. Neither changes the stored state (a failed round applies nothing).
    """

    def __init__(self, rule: UpdateRule, moments: dict[str, torch.Tensor], step: int, zbar: torch.Tensor):
        self.rule, self.moments, self.step, self.zbar = rule, moments, step, zbar
        self.lr = rule.gamma * rule.schedule.factor(step)
        self._denom: torch.Tensor | None = None
        self._trust: list[float] | None = None

    def extrapolate(self, d0: torch.Tensor) -> torch.Tensor:
        """``zbar - lr * u0`` (before projection)."""
        u, _ = self._direction(d0, first=True)
        return self.zbar - self.lr * u

    def update(self, d1: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``zbar - lr * u1`` (before projection) and the new moments."""
        if self._denom is None and self.rule.adaptive:
            raise RuntimeError("extrapolate() first: the update reuses its preconditioner")
        u, moments = self._direction(d1, first=False)
        return self.zbar - self.lr * u, moments

    def _direction(self, d: torch.Tensor, *, first: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rule = self.rule
        d = rule.clip(d)
        if rule.name == "sgd":
            return (d if rule.weight_decay == 0 else d + rule.decay_term(self.zbar)), {}
        if rule.name == "adam" and rule.weight_decay:
            d = d + rule.decay_term(self.zbar)  # Adam's L2 penalty: part of the gradient
        t = self.step + 1
        b1, b2 = rule.beta1, rule.beta2
        m = b1 * self.moments[MOMENT_M] + (1.0 - b1) * d
        v = b2 * self.moments[MOMENT_V] + (1.0 - b2) * d * d
        own = (v / (1.0 - b2**t)).sqrt() + rule.eps
        if first:
            self._denom = own
        assert self._denom is not None
        # the update never divides by less than its own Adam denominator: a direction far larger than the
        # extrapolation's on some coordinate would otherwise be amplified by |d1| / |d0| there
        denom = self._denom if first else torch.maximum(self._denom, own)
        u = (m / (1.0 - b1**t)) / denom
        if rule.name in ("adamw", "lamb") and rule.weight_decay:
            u = u + rule.decay_term(self.zbar)
        if rule.name == "lamb":
            if first:
                self._trust = rule.trust_ratios(self.zbar, u)
            assert self._trust is not None
            u = rule.scale_segments(u, self._trust)
        return u, {MOMENT_M: m, MOMENT_V: v}


class UpdateRule:
    """``UpdateRule(name="adam", gamma=1e-3, schedule=Schedule(...), segments=[...])``.

    ``init_moments(dim)`` gives the replicated optimizer state (empty for SGD); ``plan(moments, step,
    zbar)`` the step's two moves. ``gamma`` is the base stepsize (the learning rate).
    """

    def __init__(
        self,
        *,
        name: str = "sgd",
        gamma: float,
        schedule: Schedule | None = None,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_norm: float | None = None,
        segments: Sequence[Segment] | None = None,
    ) -> None:
        if name not in ("sgd", "adam", "adamw", "lamb"):
            raise ValueError(f"unknown optimizer {name!r}")
        if gamma <= 0:
            raise ValueError("gamma must be positive")
        self.name, self.gamma = name, float(gamma)
        self.schedule = schedule or Schedule()
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.weight_decay, self.clip_norm = float(weight_decay), clip_norm
        self.segments = list(segments) if segments else None
        self._decay_mask: torch.Tensor | None = None

    @property
    def adaptive(self) -> bool:
        return self.name != "sgd"

    def init_moments(self, dim: int) -> dict[str, torch.Tensor]:
        if not self.adaptive:
            return {}
        return {MOMENT_M: torch.zeros(dim), MOMENT_V: torch.zeros(dim)}

    def plan(self, moments: dict[str, torch.Tensor], step: int, zbar: torch.Tensor) -> StepPlan:
        if self.adaptive and (MOMENT_M not in moments or MOMENT_V not in moments):
            raise ValueError(f"{self.name} needs its moments in the method state")
        return StepPlan(self, moments, step, zbar)

    # ---- pieces ---------------------------------------------------------------------------------
    def clip(self, d: torch.Tensor) -> torch.Tensor:
        if self.clip_norm is None:
            return d
        norm = float(d.norm())
        return d if norm <= self.clip_norm else d * (self.clip_norm / norm)

    def decay_term(self, z: torch.Tensor) -> torch.Tensor:
        mask = self._mask(z.numel())
        term = self.weight_decay * z
        return term if mask is None else term * mask

    def _mask(self, dim: int) -> torch.Tensor | None:
        if self.segments is None or all(s.decay for s in self.segments):
            return None
        if self._decay_mask is None or self._decay_mask.numel() != dim:
            self._decay_mask = torch.cat(
                [torch.full((s.size,), 1.0 if s.decay else 0.0) for s in self.segments]
            )
        return self._decay_mask

    def _split(self, x: torch.Tensor) -> Sequence[torch.Tensor]:
        sizes = [s.size for s in self.segments] if self.segments else [x.numel()]
        if sum(sizes) != x.numel():
            raise ValueError(f"segments cover {sum(sizes)} coordinates, the vector has {x.numel()}")
        return torch.split(x, sizes)

    def trust_ratios(self, z: torch.Tensor, u: torch.Tensor) -> list[float]:
        ratios = []
        for zs, us in zip(self._split(z), self._split(u), strict=True):
            zn, un = float(zs.norm()), float(us.norm())
            ratios.append(1.0 if zn == 0 or un == 0 else min(MAX_TRUST_RATIO, zn / un))
        return ratios

    def scale_segments(self, u: torch.Tensor, ratios: Sequence[float]) -> torch.Tensor:
        return torch.cat([us * r for us, r in zip(self._split(u), ratios, strict=True)])


def sgd(gamma: float) -> UpdateRule:
    """The paper's constant-stepsize update."""
    return UpdateRule(name="sgd", gamma=gamma)
