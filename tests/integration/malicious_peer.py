"""A hostile volunteer for tests: a real ``collab join`` whose averaging parts are tampered with.

``python -m tests.integration.malicious_peer MODE JOIN-ARGS...`` with MODE one of

* ``nan``      - its parts carry NaN values;
* ``scale``    - its parts are 1e6 times larger than honest ones;
* ``index``    - its sparse parts carry an index past the end of the vector;
* ``oversize`` - its parts are padded past the run's ``max_message_bytes``;
* ``weight``   - its parts are honest but claim far more samples than its device can have computed.

Everything else - matchmaking, state, records - is the unmodified peer. Only tests start this.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

import collab.swarm.allreduce as allreduce
from collab.compression import CompressedMessage, MessageKind

PAD_BYTES = 3 * 1024 * 1024  # tests set swarm.max_message_bytes below this
CLAIM_FACTOR = 1e4  # a claimed weight this many times its real samples


class _Padded(CompressedMessage):
    def to_bytes(self) -> bytes:
        return super().to_bytes() + b"\0" * PAD_BYTES


def tamper(part: CompressedMessage, mode: str) -> CompressedMessage:
    if mode == "nan":
        values = part.values.clone()
        values[: max(1, values.numel() // 2)] = math.nan
        return replace(part, values=values)
    if mode == "scale":
        return replace(part, values=part.values * 1e6)
    if mode == "index":
        if part.kind != MessageKind.SPARSE or part.indices is None:
            return part  # e.g. the dense initialization round: nothing to index
        indices = torch.cat([part.indices, torch.tensor([part.numel + 7])])
        values = torch.cat([part.values, torch.ones(1)])
        return replace(part, indices=indices, values=values)
    if mode == "oversize":
        return _Padded(part.kind, part.numel, part.values, part.indices, part.seed, part.step)
    raise SystemExit(f"unknown mode {mode!r}")


def main(argv: Sequence[str]) -> int:
    mode, rest = argv[0], list(argv[1:])
    honest_split = allreduce.split

    def hostile_split(msg: CompressedMessage, n: int, layout: str | None = None) -> list[CompressedMessage]:
        return [tamper(p, mode) for p in honest_split(msg, n, layout)]

    if mode == "weight":
        honest_reduce = allreduce.ExactReducer.reduce

        async def inflated(self: Any, group: Any, message: Any, weight: float, *rest: Any) -> Any:
            return await honest_reduce(self, group, message, weight * CLAIM_FACTOR, *rest)

        allreduce.ExactReducer.reduce = inflated  # type: ignore[method-assign]
    else:
        allreduce.split = hostile_split  # type: ignore[assignment]
    from peers.cli import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
