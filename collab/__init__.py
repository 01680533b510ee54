"""collab: volunteer collaborative training with compressed communication (MASHA methods).

Library layers (imports flow downward only):
``collab.swarm`` (networking) -> ``collab.methods`` -> ``collab.compression`` / ``collab.tasks``
-> ``collab.config`` / ``collab.rng``.
"""

__version__ = "0.1.0"
