from tests.integration.swarm_harness import node_trio, swarm

__all__ = ["node_trio", "swarm"]
