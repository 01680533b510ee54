"""A hostile volunteer for tests: a real ``collab join`` whose averaging parts are tampered with.

``python -m tests.integration.malicious_peer MODE JOIN-ARGS...`` with MODE one of

* ``nan``      - its parts carry NaN values;
* ``scale``    - its parts are 1e6 times larger than honest ones;
* ``index``    - its sparse parts carry an index past the end of the vector;
* ``oversize`` - its parts are padded past the run's ``max_message_bytes``;
* ``weight``   - its parts are honest but claim far more samples than its device can have computed;
* ``split``    - as a part owner, it sends a slightly different version of its part (each one signed) to
  half of the members;
* ``forge``    - it trains honestly, but says it is a few steps ahead (so peers that catch up ask it
  first) and serves a forged state (perturbed parameters, with the hash of the forged bytes).

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
FORGE_AHEAD = 30  # steps a forger claims to be ahead of its real state (records lag by a beat)


class _Padded(CompressedMessage):
    def to_buffers(self) -> list[bytes | memoryview]:  # what a part goes out as (to_bytes joins these)
        return [*super().to_buffers(), b"\0" * PAD_BYTES]


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

    if mode == "forge":
        _forge_state()
    elif mode == "split":
        _split_parts()
    elif mode == "weight":
        honest_reduce = allreduce.ExactReducer.reduce

        async def inflated(self: Any, group: Any, message: Any, weight: float, *rest: Any) -> Any:
            return await honest_reduce(self, group, message, weight * CLAIM_FACTOR, *rest)

        allreduce.ExactReducer.reduce = inflated  # type: ignore[method-assign]
    else:
        allreduce.split = hostile_split  # type: ignore[assignment]
    from peers.cli import main as cli_main

    return cli_main(rest)


def _split_parts() -> None:
    from collab.swarm.agreement import Statement, _statement_message, part_digest

    honest_handle = allreduce.ExactReducer._handle_part

    async def split(self: Any, header: Any, payload: bytes, remote: str) -> Any:
        answer, wire = await honest_handle(self, header, payload, remote)
        blob = b"".join(wire) if isinstance(wire, list) else wire  # answers may go out in pieces
        if int(header["sender"]) % 2 == 0:
            part = CompressedMessage.from_bytes(blob)
            blob = replace(part, values=part.values * 1.001 + 1e-6).to_bytes()
            digest = part_digest(str(header["group_id"]), int(header["part"]), blob, answer["excluded"])
            gid, j = str(header["group_id"]), int(header["part"])
            # signed past Agreement.sign, which refuses an honest owner a second version of a part
            signature = self.agreement._key.sign(_statement_message(gid, j, digest)).hex()
            answer = {**answer, "statement": Statement(digest, self.agreement.public, signature).to_wire()}
        return answer, blob

    allreduce.ExactReducer._handle_part = split  # type: ignore[method-assign]


def _forge_state() -> None:
    import collab.swarm.catchup as catchup
    import collab.swarm.volunteer as volunteer
    from collab.methods.base import MethodState

    honest_record = volunteer.Volunteer._alive_record
    made: dict[str, MethodState] = {}  # honest hash -> its forgery (a download reads it chunk by chunk)

    def forged(self: Any) -> MethodState | None:
        state = self.method.state
        if state is None:
            return None
        if state.hash() not in made:
            fake = state.clone()
            fake.z.add_(0.5)  # what a forger would like everyone to train from
            made.clear()
            made[state.hash()] = fake
        return made[state.hash()]

    def ahead(self: Any, status: Any = None) -> Any:
        record = honest_record(self, status)
        return replace(record, step=record.step + FORGE_AHEAD) if record.step >= 0 else record

    catchup.StateService.served = forged  # type: ignore[method-assign]
    volunteer.Volunteer._alive_record = ahead  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
