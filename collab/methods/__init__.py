"""Methods as pure state machines over an Aggregator (never imports networking)."""

from collab.methods.base import (
    Aggregator,
    CommStats,
    Contribution,
    Method,
    MethodState,
    RoundFailed,
    RoundKey,
    StepReport,
    Worker,
)
from collab.methods.extragradient import ExtraGradient
from collab.methods.masha import MASHA1, MASHA2
from collab.methods.simulated import SimulatedAggregator

__all__ = [
    "MASHA1",
    "MASHA2",
    "Aggregator",
    "CommStats",
    "Contribution",
    "ExtraGradient",
    "Method",
    "MethodState",
    "RoundFailed",
    "RoundKey",
    "SimulatedAggregator",
    "StepReport",
    "Worker",
]
