"""A volunteer whose connection breaks as one round's answer comes back: a real ``collab join`` that, in
round ``ROUND`` (e.g. ``8.delta``), completes its side of the exchange - every owner got its part and the
group commits with its contribution - and then drops the result, as if the answers were lost on the way.

``python -m tests.integration.lossy_peer ROUND JOIN-ARGS...``. Everything else is the unmodified peer.
Only tests start this.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import collab.swarm.allreduce as allreduce
from collab.methods.base import RoundFailed


def main(argv: Sequence[str]) -> int:
    lost_round, rest = argv[0], list(argv[1:])
    honest_reduce = allreduce.ExactReducer.reduce
    lost: list[str] = []

    async def lossy_reduce(self: allreduce.ExactReducer, group: Any, *args: Any, **kwargs: Any) -> Any:
        result = await honest_reduce(self, group, *args, **kwargs)
        if group.round_id == lost_round and not lost:
            lost.append(group.group_id)
            raise RoundFailed(f"round {lost_round}: the answers were lost (test)")
        return result

    allreduce.ExactReducer.reduce = lossy_reduce  # type: ignore[method-assign]
    from peers.cli import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
