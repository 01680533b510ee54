"""Extragradient with exact uncompressed averaging: the baseline of "bits to reach accuracy".

    z_half  = proj(z - gamma * F(z))
    z_next  = proj(z - gamma * F(z_half))

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
        return MethodState(step=0, z=z, w=z.clone(), fw=torch.zeros_like(z))

    def _step(self, state: MethodState) -> tuple[MethodState, list[torch.Tensor | None], bool]:
        k = state.step
        weights = [w.operator.weight for w in self.workers]
        fz = self._dense_average(
            RoundKey(k, "eg-z"),
            [w.operator.evaluate([state.z], step=k)[0] for w in self.workers],
            weights,
        )
        z_half = self.project(state.z - self.gamma * fz)
        fh = self._dense_average(
            RoundKey(k, "eg-half"),
            [w.operator.evaluate([z_half], step=k)[0] for w in self.workers],
            weights,
        )
        z_next = self.project(state.z - self.gamma * fh)
        return MethodState(step=k + 1, z=z_next, w=state.z.clone(), fw=fz), [None] * len(self.workers), False
