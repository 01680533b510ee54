"""The paper's regularized bilinear saddle point, split over ``M`` devices, with its exact solution.

    min_x max_y  f(x, y) = (1/M) sum_m [ x^T A_m y + a_m^T x + b_m^T y ] + (lam/2)||x||^2 - (lam/2)||y||^2

so ``F_m(x, y) = (A_m y + a_m + lam x,  -A_m^T x - b_m + lam y)``; ``F`` is ``lam``-strongly monotone
and ``L``-Lipschitz with ``L = ||A|| + lam``. The solution ``z*`` solves the linear system ``F(z) = 0``.
The metric is ``||z - z*||^2 / ||z^0 - z*||^2``.

Data (all from the run seed, so every device and the simulator build the same instance): a shared
matrix ``A`` with iid N(0, 1/n) entries plus a per-device deviation ``heterogeneity * N(0, 1/n)``,
and ``a_m, b_m ~ N(0, 1)``. Deterministic: every evaluation is exact (``step`` is ignored).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from collab.rng import torch_seed
from collab.tasks.base import LocalOperator, Task


class BilinearOperator(LocalOperator):
    def __init__(self, *, a_mat: torch.Tensor, a_vec: torch.Tensor, b_vec: torch.Tensor, lam: float) -> None:
        self.a_mat, self.a_vec, self.b_vec, self.lam = a_mat, a_vec, b_vec, lam
        self.n = a_vec.numel()
        self.dim = 2 * self.n

    def _at(self, z: torch.Tensor) -> torch.Tensor:
        x, y = z[: self.n], z[self.n :]
        gx = self.a_mat @ y + self.a_vec + self.lam * x
        gy = -(self.a_mat.T @ x) - self.b_vec + self.lam * y
        return torch.cat([gx, gy])

    def evaluate(
        self, points: Sequence[torch.Tensor], *, step: int, full: bool = False, microbatch: int = 0
    ) -> list[torch.Tensor]:
        return [self._at(p) for p in points]  # deterministic: every microbatch is the whole operator

    @property
    def exact(self) -> bool:
        return True


class BilinearTask(Task):
    """``BilinearTask(dim=n, num_devices=M, reg_lambda=lam, seed=s)``; ``z`` has ``2n`` coordinates."""

    metric_name = "rel_distance"

    def __init__(
        self,
        *,
        dim: int,
        num_devices: int,
        reg_lambda: float,
        seed: int,
        heterogeneity: float = 1.0,
        init_scale: float = 1.0,
    ) -> None:
        self.n, self.num_devices, self.lam = dim, num_devices, reg_lambda
        self.dim = 2 * dim
        scale = 1.0 / dim**0.5
        g = torch.Generator().manual_seed(torch_seed(seed, 0, "bilinear-shared"))
        shared = torch.randn(dim, dim, generator=g, dtype=torch.float64) * scale
        self._mats, self._avecs, self._bvecs = [], [], []
        for m in range(num_devices):
            gm = torch.Generator().manual_seed(torch_seed(seed, 0, "bilinear-device", m))
            dev = torch.randn(dim, dim, generator=gm, dtype=torch.float64) * (scale * heterogeneity)
            self._mats.append(shared + dev)
            self._avecs.append(torch.randn(dim, generator=gm, dtype=torch.float64))
            self._bvecs.append(torch.randn(dim, generator=gm, dtype=torch.float64))
        g0 = torch.Generator().manual_seed(torch_seed(seed, 0, "bilinear-init"))
        self._z0 = (torch.randn(self.dim, generator=g0, dtype=torch.float64) * init_scale).float()
        self.solution = self._solve().float()
        self._d0 = float(torch.sum((self._z0.double() - self.solution.double()) ** 2))

    def _solve(self) -> torch.Tensor:
        a = torch.stack(self._mats).mean(0)
        av = torch.stack(self._avecs).mean(0)
        bv = torch.stack(self._bvecs).mean(0)
        n, lam = self.n, self.lam
        eye = torch.eye(n, dtype=torch.float64)
        # F(z) = J z + c = 0 with J = [[lam I, A], [-A^T, lam I]], c = (a, -b)
        jac = torch.cat([torch.cat([lam * eye, a], 1), torch.cat([-a.T, lam * eye], 1)], 0)
        return torch.linalg.solve(jac, -torch.cat([av, -bv]))

    def lipschitz(self) -> float:
        """Lipschitz constant of the averaged operator F (spectral norm of its Jacobian)."""
        a = torch.stack(self._mats).mean(0)
        return float(torch.linalg.matrix_norm(a, ord=2)) + self.lam

    def initial_point(self) -> torch.Tensor:
        return self._z0.clone()

    def local_operator(self, index: int) -> BilinearOperator:
        return BilinearOperator(
            a_mat=self._mats[index].float(),
            a_vec=self._avecs[index].float(),
            b_vec=self._bvecs[index].float(),
            lam=self.lam,
        )

    def metric(self, z: torch.Tensor) -> float:
        return float(torch.sum((z.double() - self.solution.double()) ** 2)) / self._d0
