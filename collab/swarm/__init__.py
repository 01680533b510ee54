"""The swarm layer: the only package that imports hivemind.

``SwarmNode`` (DHT + calls between peers), ``Matchmaker`` (groups keyed by step), ``ExactReducer``
(bit-identical averaging), ``SwarmAggregator`` (the methods' Aggregator on real peers) and ``Volunteer``
(one peer's training loop with state sync).
"""

from collab.swarm.aggregator import SwarmAggregator
from collab.swarm.transport import SwarmNode, TransportError
from collab.swarm.volunteer import Volunteer

__all__ = ["SwarmAggregator", "SwarmNode", "TransportError", "Volunteer"]
