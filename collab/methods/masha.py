"""MASHA1 (unbiased compressors) and MASHA2 (contractive compressors with error feedback).

Beznosikov, Richtárik, Diskin, Ryabinin, Gasnikov, "Distributed Methods with Compressed Communication for
Solving Variational Inequalities, with Theoretical Guarantees", NeurIPS 2022 (arXiv 2110.03313).
Notation and the exact form implemented are in docs/ALGORITHMS.md. One step ``k``:

    zbar    = tau z^k + (1 - tau) w^k      (or (1 - a) z^k + a w^k with an explicit ``anchor`` a)
    z_half  = proj(zbar - gamma F(w^k))
    device m: delta_m = F_m(z_half) - F_m(w^k)             (same minibatch for both evaluations)
      MASHA1: send Q_m(delta_m)                             (Rand-k on the shared (seed, k) coordinates)
      MASHA2: c_m = C_m(e_m + delta_m); e_m += delta_m - c_m; send c_m
    group ("server"), identical on every member:
      MASHA1: g = Q_serv(mean_m msg_m)
      MASHA2: s = mean_m c_m; g = C_serv(e + s); e += s - g
    z^{k+1} = proj(zbar - gamma (F(w^k) + g))
      (with an adaptive optimizer both moves are Extra-Adam steps sharing one preconditioner:
       collab/methods/optimizers.py)
    shared coin b_k ~ Bernoulli(1 - tau) from (seed, k):
      b_k = 1: w^{k+1} = z^{k+1}, F(w^{k+1}) by an exact uncompressed average (a round of its own)
      b_k = 0: w^{k+1} = w^k
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from collab.compression import CompressedMessage, Compressor, Identity
from collab.methods.base import Aggregator, Contribution, Method, MethodState, RoundKey, Worker
from collab.methods.optimizers import UpdateRule
from collab.rng import coin, derived_seed


class _Masha(Method):
    def __init__(
        self,
        *,
        z0: torch.Tensor,
        workers: Sequence[Worker],
        aggregator: Aggregator,
        gamma: float,
        tau: float,
        seed: int,
        server_compressor: Compressor | None = None,
        project: Callable[[torch.Tensor], torch.Tensor] | None = None,
        optimizer: UpdateRule | None = None,
        anchor: float | None = None,
    ) -> None:
        super().__init__(
            z0=z0,
            workers=workers,
            aggregator=aggregator,
            gamma=gamma,
            seed=seed,
            project=project,
            optimizer=optimizer,
        )
        if not 0 <= tau < 1:
            raise ValueError("tau must be in [0, 1)")
        self.tau = float(tau)
        if anchor is not None and not 0 <= anchor < 1:
            raise ValueError("anchor must be in [0, 1)")
        # zbar's weights on z and w: the paper's (tau, 1 - tau), or an explicit pull toward w
        self._mix = (self.tau, 1.0 - self.tau) if anchor is None else (1.0 - anchor, float(anchor))
        self.server_compressor = server_compressor or Identity()
        self._server_seed = derived_seed(seed, "server-compressor")

    def _initial_state(self) -> MethodState:
        z = self.project(self._z0.clone())
        fw = self._full_operator(RoundKey(0, "init"), z, step=0)
        server_error = torch.zeros_like(z) if self.error_feedback else None
        for worker in self.workers:
            worker.error = torch.zeros_like(z) if self.error_feedback else None
        return MethodState(
            step=0,
            z=z,
            w=z.clone(),
            fw=fw,
            server_error=server_error,
            extra=self.optimizer.init_moments(z.numel()),
        )

    def _seed_of(self, worker: Worker) -> int:
        return self.seed if worker.compress_seed is None else worker.compress_seed

    def _full_operator(self, key: RoundKey, point: torch.Tensor, *, step: int) -> torch.Tensor:
        self.aggregator.prepare(key)
        evaluated = [self._evaluate(w, [point], step=step, full=True) for w in self.workers]
        return self._dense_average(key, [f[0] for f, _, _ in evaluated], [wt for _, wt, _ in evaluated])

    def _server(
        self, mean: CompressedMessage, error: torch.Tensor | None, step: int
    ) -> tuple[CompressedMessage, torch.Tensor | None]:
        """The group's server step: identical input -> identical output on every member."""
        if isinstance(self.server_compressor, Identity) and (error is None or not torch.any(error)):
            return mean, error
        dense = mean.decompress() if error is None else error + mean.decompress()
        g = self.server_compressor.compress(dense, seed=self._server_seed, step=step)
        new_error = None if error is None else dense - g.decompress()
        return g, new_error

    def _step(self, state: MethodState) -> tuple[MethodState, list[torch.Tensor | None], bool]:
        k = state.step
        keep, pull = self._mix
        zbar = keep * state.z + pull * state.w if pull else state.z.clone()
        plan = self.optimizer.plan(state.extra, k, zbar)  # sgd: zbar - gamma * direction
        z_half = self.project(plan.extrapolate(state.fw))

        contributions: list[Contribution] = []
        new_errors: list[torch.Tensor | None] = []
        self.aggregator.prepare(RoundKey(k, "delta"))
        for worker in self.workers:
            (f_half, f_w), weight, _ = self._evaluate(worker, [z_half, state.w], step=k)
            delta = f_half - f_w
            if weight == 0:  # tagging along: an empty message, the residual stays for later rounds
                msg = worker.compressor.compress(torch.zeros_like(delta), seed=self._seed_of(worker), step=k)
                new_errors.append(worker.error)
            elif self.error_feedback:
                assert worker.error is not None
                target = worker.error + delta
                msg = worker.compressor.compress(target, seed=self._seed_of(worker), step=k)
                new_errors.append(target - msg.decompress())
            else:
                msg = worker.compressor.compress(delta, seed=self._seed_of(worker), step=k)
                new_errors.append(None)
            contributions.append(Contribution(msg, weight))

        server_out: dict[str, torch.Tensor | None] = {}

        def server(mean: CompressedMessage) -> CompressedMessage:
            g_msg, err = self._server(mean, state.server_error, k)
            server_out["error"] = err
            return g_msg

        try:
            g = self.aggregator.reduce(RoundKey(k, "delta"), contributions, server).decompress()
        finally:
            self._sent(new_errors)  # the buffers that go with what was sent, should this step fail here
        moved, moments = plan.update(state.fw + g)
        z_next = self.project(moved)

        refreshed = coin(self.seed, k, "masha-reference", 1.0 - self.tau)
        if refreshed:
            w_next, fw_next = z_next.clone(), self._full_operator(RoundKey(k, "refresh"), z_next, step=k)
        else:
            w_next, fw_next = state.w, state.fw
        new_state = MethodState(
            step=k + 1,
            z=z_next,
            w=w_next,
            fw=fw_next,
            server_error=server_out.get("error", state.server_error),
            extra=moments,
        )
        return new_state, new_errors, refreshed


class MASHA1(_Masha):
    """MASHA1: loopless variance-reduced extragradient with unbiased (e.g. Rand-k) compression.

    Example::

        agg = SimulatedAggregator(num_devices=4)
        workers = [Worker(task.local_operator(m), RandK(ratio=0.1)) for m in range(4)]
        method = MASHA1(z0=task.initial_point(), workers=workers, aggregator=agg, gamma=0.1, tau=0.9, seed=0)
        for _ in range(1000):
            method.step()
    """

    name = "masha1"
    error_feedback = False


class MASHA2(_Masha):
    """MASHA2: MASHA1's structure with contractive (e.g. Top-k) compression and error feedback on every
    device and on the (replicated) server."""

    name = "masha2"
    error_feedback = True
