from tests.integration.swarm_harness import swarm

__all__ = ["swarm"]
