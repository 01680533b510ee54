"""A volunteer that dies in the middle of a round: a real ``collab join`` that, in round ``ROUND`` (e.g.
``12.delta``; ``first.delta``: the first round of that phase it takes part in), sends its parts and, once
another member's part has reached it or its own part is on its way to another member (so that member is
in the round too; a small round has one owner, to which the others send), SIGKILLs its whole process
group - itself, its DHT and p2pd - before the results come back; from the moment that round begins it never
answers a part call again, nor sends its confirmation (as a machine that went down: a small round with one
owner can complete within the moments before the kill). Everything else is the unmodified peer. Only
tests start this (torchft-style ``fail_at(peer, step)``).

``python -m tests.integration.dying_peer ROUND JOIN-ARGS...``
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import collab.swarm.allreduce as allreduce

logger = logging.getLogger("collab.tests.dying_peer")


def main(argv: Sequence[str]) -> int:
    fail_round, rest = argv[0], list(argv[1:])
    honest_reduce = allreduce.ExactReducer.reduce
    honest_handle = allreduce.ExactReducer._handle_part
    honest_call = allreduce.SwarmNode.call
    honest_confirm = allreduce.Agreement.confirm
    dying = asyncio.Event()
    arrived: set[object] = set()  # rounds where some other member sent this peer a part, or got ours

    first = fail_round.startswith("first.")

    def fatal(round_id: object) -> bool:
        if first:
            return isinstance(round_id, str) and round_id.endswith(fail_round.removeprefix("first"))
        return round_id == fail_round

    async def handle_part(self: allreduce.ExactReducer, header: Any, payload: bytes, remote: str) -> Any:
        arrived.add(header.get("round"))
        if dying.is_set() or (not first and fatal(header.get("round"))):
            await asyncio.sleep(3600)  # about to die: never answer
        answer = await honest_handle(self, header, payload, remote)
        if dying.is_set():  # a part that came before the round began here: its answer never leaves either
            await asyncio.sleep(3600)  # (on a fast machine a tiny round completes within the 50 ms below)
        return answer

    async def call(
        self: allreduce.SwarmNode, peer: str, method: str, header: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if method == allreduce.PART:
            arrived.add(header.get("round"))
        return await honest_call(self, peer, method, header, *args, **kwargs)

    async def confirm(self: allreduce.Agreement, *args: Any, **kwargs: Any) -> Any:
        if dying.is_set():
            await asyncio.sleep(3600)  # about to die: its list never leaves
        return await honest_confirm(self, *args, **kwargs)

    async def reduce(self: allreduce.ExactReducer, group: Any, *args: Any, **kwargs: Any) -> Any:
        if not fatal(group.round_id):
            return await honest_reduce(self, group, *args, **kwargs)
        dying.set()
        task = asyncio.ensure_future(honest_reduce(self, group, *args, **kwargs))
        # die only once another member is in the round (it sent us its part): dying before anyone learnt
        # of the group would break nobody's round but ours
        for _ in range(1000):
            if group.round_id in arrived:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # our parts are on their way; the answers are not back yet
        logger.warning("fault injection: killing this peer in the middle of round %s", group.round_id)
        os.killpg(os.getpgrp(), signal.SIGKILL)
        return await task

    allreduce.ExactReducer._handle_part = handle_part  # type: ignore[method-assign]
    allreduce.SwarmNode.call = call  # type: ignore[method-assign]
    allreduce.Agreement.confirm = confirm  # type: ignore[method-assign]
    allreduce.ExactReducer.reduce = reduce  # type: ignore[method-assign]
    from peers.cli import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
