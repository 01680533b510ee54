"""SimulatedAggregator: M devices in one process, the oracle the real swarm must match.

Averages the devices' messages with :func:`collab.compression.weighted_mean` in device order (the same
fixed-order float64 accumulation the swarm uses), applies the server step and counts the paper's bits
per device: device->server (mean over devices of their message size) and server->device.
"""

from __future__ import annotations

from collections.abc import Sequence

from collab.compression import CompressedMessage, weighted_mean
from collab.methods.base import Aggregator, CommStats, Contribution, RoundKey, ServerFn


class SimulatedAggregator(Aggregator):
    """``SimulatedAggregator(num_devices=M)``: every device is local, the group is always all M."""

    def __init__(self, *, num_devices: int) -> None:
        if num_devices < 1:
            raise ValueError("num_devices must be >= 1")
        self._m = num_devices
        self.stats = CommStats()

    @property
    def num_local(self) -> int:
        return self._m

    def reduce(
        self, key: RoundKey, contributions: Sequence[Contribution], server: ServerFn
    ) -> CompressedMessage:
        if len(contributions) != self._m:
            raise ValueError(f"round {key}: expected {self._m} contributions, got {len(contributions)}")
        mean = weighted_mean([c.message for c in contributions], [c.weight for c in contributions])
        out = server(mean)
        self.stats.bits_up += sum(c.message.bits for c in contributions) / self._m
        self.stats.bits_down += out.bits
        self.stats.rounds += 1
        return out
