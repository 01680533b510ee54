"""SimulatedAggregator: M devices in one process, the oracle the real swarm must match.

Averages the devices' messages with :func:`collab.compression.weighted_mean` in device order (the same
fixed-order float64 accumulation the swarm uses), after clipping long parts as the swarm's part owners do
(``clipping``: :class:`~collab.compression.clip.PartClipping`), applies the server step and counts the
paper's bits per device: device->server (mean over devices of their message size) and server->device.
"""

from __future__ import annotations

from collections.abc import Sequence

from collab.compression import CompressedMessage, weighted_mean
from collab.compression.clip import PartClipping
from collab.config import RunConfig
from collab.methods.base import Aggregator, CommStats, Contribution, RoundKey, ServerFn


class SimulatedAggregator(Aggregator):
    """``SimulatedAggregator(num_devices=M, clipping=...)``: every device is local, the group is always
    all M (``clipping``: the run's, so that the simulation equals the swarm; ``None``: plain average)."""

    def __init__(self, *, num_devices: int, clipping: PartClipping | None = None) -> None:
        if num_devices < 1:
            raise ValueError("num_devices must be >= 1")
        self._m = num_devices
        self.clipping = clipping
        self.stats = CommStats()

    @classmethod
    def for_run(cls, cfg: RunConfig) -> SimulatedAggregator:
        """All ``cfg.num_devices`` devices, clipping as the run's part owners do."""
        sw = cfg.swarm
        clipping = PartClipping(sw.max_norm_ratio, sw.single_owner_bytes, cfg.seed)
        return cls(num_devices=cfg.num_devices, clipping=clipping)

    @property
    def num_local(self) -> int:
        return self._m

    def reduce(
        self, key: RoundKey, contributions: Sequence[Contribution], server: ServerFn
    ) -> CompressedMessage:
        if len(contributions) != self._m:
            raise ValueError(f"round {key}: expected {self._m} contributions, got {len(contributions)}")
        messages, weights = [c.message for c in contributions], [c.weight for c in contributions]
        clipped = self.clipping.clip(messages, weights) if self.clipping is not None else messages
        mean = weighted_mean(clipped, weights)
        out = server(mean)
        self.stats.bits_up += sum(c.message.bits for c in contributions) / self._m
        self.stats.bits_down += out.bits
        self.stats.rounds += 1
        return out
