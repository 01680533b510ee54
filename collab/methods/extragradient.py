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
    local_start = True

    def _initial_state(self) -> MethodState:
        z = self.project(self._z0.clone())
        return MethodState(
            step=0, z=z, w=z.clone(), fw=torch.zeros_like(z), extra=self.optimizer.init_moments(z.numel())
        )

    def _step(self, state: MethodState) -> tuple[MethodState, list[torch.Tensor | None], bool]:
        k = state.step
        self.aggregator.prepare(RoundKey(k, "eg-z"))
        at_z = [self._evaluate(w, [state.z], step=k) for w in self.workers]
        weights = [weight for _, weight, _ in at_z]
        fz = self._dense_average(RoundKey(k, "eg-z"), [f[0] for f, _, _ in at_z], weights)
        plan = self.optimizer.plan(state.extra, k, state.z)  # sgd: z - gamma * direction
        z_half = self.project(plan.extrapolate(fz))
        self.aggregator.prepare(RoundKey(k, "eg-half"))
        # the same microbatches at z_half as at z (their count is this device's, from the first round)
        at_half = [
            self._evaluate(w, [z_half], step=k, count=n)
            for w, (_, _, n) in zip(self.workers, at_z, strict=True)
        ]
        self._step_samples -= sum(weights)  # the same samples again: counted once
        fh = self._dense_average(RoundKey(k, "eg-half"), [f[0] for f, _, _ in at_half], weights)
        moved, moments = plan.update(fh)
        z_next = self.project(moved)
        new_state = MethodState(step=k + 1, z=z_next, w=state.z.clone(), fw=fz, extra=moments)
        return new_state, [None] * len(self.workers), False
