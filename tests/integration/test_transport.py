"""Frames between two real peers: payloads sent in pieces and read in slices arrive whole and in order.

Large payloads (a 100M-parameter round's parts) are written slice by slice and read into one buffer
allocated up front; small ones in one go. Both must give back exactly the bytes sent, whatever the
pieces, and count the same bytes on both sides.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from collab.swarm.transport import IO_SLICE, TAKEN, Header, Payloads, Received, SwarmNode


async def _echo(header: Header, payload: Received, remote: str) -> tuple[Header, Payloads]:
    digest = hashlib.sha256(payload).hexdigest()
    half = len(payload) // 2
    view = memoryview(payload)
    writable = isinstance(payload, memoryview) and not payload.readonly
    return {"sha": digest, "writable": writable}, [view[half:], b"|", view[:half]]


@pytest.mark.timeout(120)
def test_payloads_in_pieces_and_slices_arrive_whole() -> None:
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    try:
        a.serve("echo", _echo)
        rng = np.random.default_rng(0)
        for size in (0, 1, IO_SLICE - 1, IO_SLICE + 1, 5 * IO_SLICE + 12345):
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            pieces = [
                data[: size // 3],
                memoryview(data)[size // 3 : size // 2],
                bytearray(data[size // 2 :]),
            ]
            sent0, received0 = b.bytes_sent, a.bytes_received
            header, answer = b.run(
                b.call(a.peer_key, "echo", {"n": size}, pieces, timeout_s=30), timeout_s=60
            )
            assert header["sha"] == hashlib.sha256(data).hexdigest(), size
            assert bytes(answer) == data[size // 2 :] + b"|" + data[: size // 2], size
            assert header["writable"] == (size > IO_SLICE)  # large payloads land in a writable buffer
            assert b.bytes_sent - sent0 == a.bytes_received - received0 >= size
        # an answer the caller's sink takes lands in the caller's buffers; one it does not, as usual
        data = rng.integers(0, 256, 3 * IO_SLICE, dtype=np.uint8).tobytes()
        head, body = bytearray(1), bytearray(len(data))  # the answer: data's second half, "|", first half

        def sink(answer: Header, size: int) -> list[memoryview] | None:
            return [memoryview(head), memoryview(body)] if size == 1 + len(data) else None

        _, got = b.run(b.call(a.peer_key, "echo", {}, data, timeout_s=30, sink=sink), timeout_s=60)
        half = len(data) // 2
        assert got is TAKEN and bytes(head) + bytes(body) == data[half:] + b"|" + data[:half]
        _, got = b.run(b.call(a.peer_key, "echo", {}, data[:-1], timeout_s=30, sink=sink), timeout_s=60)
        assert len(got) == len(data)  # one byte short of what the sink takes: returned as usual
        # an empty answer is an empty answer, not one the sink took
        _, got = b.run(b.call(a.peer_key, "echo", {}, b"", timeout_s=30, sink=sink), timeout_s=60)
        assert got is not TAKEN and bytes(got) == b"|"
    finally:
        b.shutdown()
        a.shutdown()
