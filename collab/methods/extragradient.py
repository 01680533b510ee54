"""Extragradient with exact uncompressed averaging: the baseline of "bits to reach accuracy".

    z_half  = proj(z - gamma * F(z))
    z_next  = proj(z - gamma * F(z_half))

With an adaptive optimizer both moves are Extra-Adam steps from ``z`` sharing one preconditioner
(Gidel et al. 2019; collab/methods/optimizers.py).

Two dense exchanges per step; each device evaluates ``F_m`` at ``z`` and ``z_half`` on the same
minibatch of the step. State ``w``/``fw`` hold ``z``/``F(z)`` of the last step for the state hash.
"""

from __future__ import annotations

import torch

from collab.methods.base import Method, MethodState, RoundKey


class ExtraGradient(Method):
    """``ExtraGradient(z0=..., workers=..., aggregator=..., gamma=..., seed=...)`` (Korpelevich 1976)."""

    name = "extragradient"

    def _initial_state(self) -> MethodState:
        z = self.project(self._z0.clone())
        return MethodState(
            step=0, z=z, w=z.clone(), fw=torch.zeros_like(z), extra=self.optimizer.init_moments(z.numel())
        )

    def _step(self, state: MethodState) -> tuple[MethodState, list[torch.Tensor | None], bool]:
        k = state.step
        weights = [w.operator.weight for w in self.workers]
        fz = self._dense_average(
            RoundKey(k, "eg-z"),
            [w.operator.evaluate([state.z], step=k)[0] for w in self.workers],
            weights,
        )
        plan = self.optimizer.plan(state.extra, k, state.z)  # sgd: z - gamma * direction
        z_half = self.project(plan.extrapolate(fz))
        fh = self._dense_average(
            RoundKey(k, "eg-half"),
            [w.operator.evaluate([z_half], step=k)[0] for w in self.workers],
            weights,
        )
        moved, moments = plan.update(fh)
        z_next = self.project(moved)
        new_state = MethodState(step=k + 1, z=z_next, w=state.z.clone(), fw=fz, extra=moments)
        return new_state, [None] * len(self.workers), False
