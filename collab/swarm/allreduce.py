"""Exact reduce-scatter / all-gather: every group member ends with the same bytes for the average.

Member ``j`` of a group (canonical order) owns part ``j`` of the layout (see
:mod:`collab.compression.partition`). Each member sends part ``j`` of its message, with its weight, to
member ``j`` in a ``collab.part`` call; the owner waits for all ``n`` parts, averages them **once** with
:func:`~collab.compression.weighted_mean` in canonical order, and answers every sender with the same
serialized result. Each member reassembles the ``n`` answers. Unlike hivemind's butterfly all-reduce (which
returns ``average - own_part`` for every sender to add back, so members differ in the last bits), nobody
adds anything afterwards: the aggregate is bit-identical on all members, and equal to the in-process
simulation's when the canonical order matches its device order.

Per member and round: about ``(n-1)/n`` of its message is sent and ``(n-1)/n`` of the aggregate received,
plus the same again as owner - independent of the group size. A missing, malformed or late part fails the
whole round for everyone (no partial aggregate is ever applied).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field

from collab.compression import CompressedMessage, MessageFormatError, weighted_mean
from collab.compression.partition import assemble, check_part, layout_of, split
from collab.config import SwarmConfig
from collab.methods.base import RoundFailed
from collab.swarm.matchmaking import Group
from collab.swarm.transport import Header, RemoteError, SwarmNode, TransportError

logger = logging.getLogger(__name__)

PART = "collab.part"

# Fault injection for tests (torchft-style ``fail_at(peer, step)``): with COLLAB_FAIL_AT=ROUND (e.g.
# "12.delta") a peer SIGKILLs its whole process group - itself, its DHT and p2pd - in the middle of that
# round: after its parts are sent, before the results come back. Unset in normal use.
FAIL_AT = os.environ.get("COLLAB_FAIL_AT") or None


class PeerUnreachable(RoundFailed):
    """The round failed because ``peer`` could not be reached (it is then avoided for a while)."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(message)
        self.peer = peer


@dataclass
class _Slot:
    """Owner-side collection of one part of one group's round."""

    n: int
    layout: str
    numel: int
    count: int | None
    shared_key: tuple[int, int] | None
    parts: dict[int, tuple[CompressedMessage, float]] = field(default_factory=dict)
    result: asyncio.Future[bytes] | None = None
    created: float = field(default_factory=time.monotonic)


class ExactReducer:
    """Serves ``collab.part`` and runs the member side of :meth:`reduce`."""

    def __init__(self, *, node: SwarmNode, cfg: SwarmConfig) -> None:
        self.node, self.cfg = node, cfg
        self._slots: dict[tuple[str, int], _Slot] = {}
        node.serve(PART, self._handle_part)

    def _slot(self, group_id: str, j: int, header: Header) -> _Slot:
        key = (group_id, j)
        slot = self._slots.get(key)
        if slot is None:
            shared = header.get("shared_key")
            slot = _Slot(
                n=int(header["n"]),
                layout=str(header["layout"]),
                numel=int(header["numel"]),
                count=None if header.get("count") is None else int(header["count"]),
                shared_key=None if shared is None else (int(shared[0]), int(shared[1])),
            )
            slot.result = asyncio.get_running_loop().create_future()
            self._slots[key] = slot
            horizon = time.monotonic() - 4 * self.cfg.allreduce_timeout_s
            for old in [k for k, s in self._slots.items() if s.created < horizon]:
                self._slots.pop(old, None)
        elif (slot.n, slot.layout, slot.numel, slot.count) != (
            int(header["n"]),
            str(header["layout"]),
            int(header["numel"]),
            None if header.get("count") is None else int(header["count"]),
        ):
            raise ValueError("part does not match the round's layout")
        return slot

    def _add(self, slot: _Slot, sender: int, part: CompressedMessage, weight: float, j: int) -> None:
        if not 0 <= sender < slot.n:
            raise ValueError(f"unexpected sender {sender}")
        if sender in slot.parts:  # a retried call: the same part again is fine, a different one is not
            old, old_weight = slot.parts[sender]
            if old.to_bytes() != part.to_bytes() or old_weight != weight:
                raise ValueError(f"sender {sender} sent two different parts")
            return
        check_part(part, layout=slot.layout, numel=slot.numel, n=slot.n, j=j, count=slot.count)
        if not weight > 0:
            raise ValueError("weight must be positive")
        slot.parts[sender] = (part, weight)
        if len(slot.parts) == slot.n and slot.result is not None and not slot.result.done():
            ordered = [slot.parts[i] for i in range(slot.n)]
            mean = weighted_mean([p for p, _ in ordered], [w for _, w in ordered])
            slot.result.set_result(mean.to_bytes())

    async def _await_result(self, slot: _Slot) -> bytes:
        assert slot.result is not None
        try:
            return await asyncio.wait_for(asyncio.shield(slot.result), self.cfg.allreduce_timeout_s)
        except TimeoutError:
            if not slot.result.done():
                slot.result.set_exception(RoundFailed(f"parts missing: got {sorted(slot.parts)} of {slot.n}"))
                slot.result.exception()
            raise RoundFailed(f"parts missing: got {sorted(slot.parts)} of {slot.n}") from None

    async def _handle_part(self, header: Header, payload: bytes, remote: str) -> tuple[Header, bytes]:
        group_id, j, sender = str(header["group_id"]), int(header["part"]), int(header["sender"])
        if FAIL_AT is not None and header.get("round") == FAIL_AT:
            await asyncio.sleep(3600)  # fault injection: this peer is about to die; never answer
        slot = self._slot(group_id, j, header)
        if slot.shared_key is not None and header.get("shared_key") != list(slot.shared_key):
            raise ValueError("members used different shared coordinates")
        try:
            part = CompressedMessage.from_bytes(payload)
        except MessageFormatError as e:
            raise ValueError(f"malformed part from {remote[-6:]}: {e}") from None
        self._add(slot, sender, part, float(header["weight"]), j)
        return {"ok": True}, await self._await_result(slot)

    async def reduce(
        self, group: Group, message: CompressedMessage, weight: float, layout: str | None = None
    ) -> CompressedMessage:
        """This member's side of the round: returns the group's weighted average (identical everywhere).

        ``layout`` must be the same on every member (default: the message's own shape).
        """
        me = group.index_of(self.node.peer_key)
        n = len(group)
        layout = layout or layout_of(message)
        parts = split(message, n, layout)
        header: Header = {
            "group_id": group.group_id,
            "n": n,
            "layout": layout,
            "numel": message.numel,
            "count": message.count if layout == "shared" else None,
            "shared_key": [message.seed, message.step] if layout == "shared" else None,
            "sender": me,
            "weight": weight,
            "round": group.round_id,
        }
        own = self._slot(group.group_id, me, header)
        self._add(own, me, parts[me], weight, me)

        async def fetch(j: int) -> bytes:
            if j == me:
                return await self._await_result(own)
            peer = group.peers[j]
            try:
                _, reduced = await self.node.call(
                    peer,
                    PART,
                    {**header, "part": j},
                    parts[j].to_bytes(),
                    timeout_s=self.cfg.allreduce_timeout_s,
                )
            except RemoteError as e:  # the owner answered: it is alive, the round failed elsewhere
                raise RoundFailed(f"part {j}: {e}") from None
            except TransportError as e:
                raise PeerUnreachable(peer, f"part {j} from {peer[-6:]}: {e}") from None
            return reduced

        tasks = [asyncio.ensure_future(fetch(j)) for j in range(n)]
        if FAIL_AT is not None and group.round_id == FAIL_AT:
            await asyncio.sleep(0.05)  # parts are on their way; the answers are not back yet
            logger.warning("fault injection: killing this peer in the middle of round %s", group.round_id)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        try:
            reduced = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        try:
            reduced_parts = [CompressedMessage.from_bytes(b) for b in reduced]
        except MessageFormatError as e:
            raise RoundFailed(f"malformed reduced part: {e}") from None
        return assemble(reduced_parts, layout=layout, numel=message.numel, template=message)
