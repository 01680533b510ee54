"""The swarm layer: the only package that imports hivemind.

``SwarmNode`` (DHT + calls between peers), ``Matchmaker`` (groups keyed by step), ``ExactReducer``
(bit-identical averaging), ``SwarmAggregator`` (the methods' Aggregator on real peers), ``Volunteer``
(one peer's training loop with state sync) and ``DhtReader`` (a torch-free DHT reader for the monitor).

Names are resolved lazily, so that ``collab.swarm.reader`` can be imported without loading hivemind's
package (and torch) first.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# hivemind's MoE layers call torch.jit.script at import, which torch >= 2.14 deprecates with a
# FutureWarning: every command would print it (and a one-line error would come after two lines of it).
warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)

_EXPORTS = {
    "SwarmAggregator": "collab.swarm.aggregator",
    "SwarmNode": "collab.swarm.transport",
    "TransportError": "collab.swarm.transport",
    "Volunteer": "collab.swarm.volunteer",
    "DhtReader": "collab.swarm.reader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'collab.swarm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
