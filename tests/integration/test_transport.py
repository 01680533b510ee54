"""Frames between two real peers: payloads sent in pieces and read in slices arrive whole and in order.

Large payloads (a 100M-parameter round's parts) are written slice by slice and read into one buffer
allocated up front; small ones in one go. Both must give back exactly the bytes sent, whatever the
pieces, and count the same bytes on both sides.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from collab.swarm.transport import (
    IO_SLICE,
    TAKEN,
    UNARY_MAX_BYTES,
    UNARY_SUFFIX,
    Header,
    Payloads,
    Received,
    SwarmNode,
)


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


@pytest.mark.timeout(120)
def test_small_frames_go_unary_and_everything_else_over_a_stream() -> None:
    """Small frames take the daemon's unary calls; a large request, a large answer (asked again over a
    stream), a peer without the unary twin of a handler, and malformed unary frames all end well."""
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    served: list[int] = []

    async def grow(header: Header, payload: Received, remote: str) -> tuple[Header, Payloads]:
        served.append(len(payload))
        return {"n": header["n"]}, bytes(range(256)) * (header["n"] // 256)

    try:
        a.serve("grow", grow)
        a.serve("echo", _echo)

        def call(name: str, header: Header, payload: Payloads = b"", **kw: object) -> tuple[Header, Received]:
            return b.run(b.call(a.peer_key, name, header, payload, timeout_s=30, **kw), timeout_s=60)  # type: ignore[arg-type]

        _, answer = call("grow", {"n": 1024}, b"x" * 100)
        assert bytes(answer) == bytes(range(256)) * 4 and served == [100]
        assert b.calls == {"unary": 1}
        assert b.bytes_sent == a.bytes_received and a.bytes_sent == b.bytes_received
        # a large answer to a small request: the unary answer says so, the call goes again over a stream
        _, answer = call("grow", {"n": 2 * UNARY_MAX_BYTES}, b"y")
        assert len(answer) == 2 * UNARY_MAX_BYTES and served[1:] == [1, 1]
        assert b.calls == {"unary": 1, "stream": 1}
        # a large request goes over a stream at once; so does one whose caller asks for it
        call("grow", {"n": 256}, b"z" * UNARY_MAX_BYTES)
        call("grow", {"n": 256}, b"z", unary=False)
        assert b.calls == {"unary": 1, "stream": 3} and served[3:] == [UNARY_MAX_BYTES, 1]
        # a small answer through the caller's sink
        data = bytes(range(200))
        head, body = bytearray(1), bytearray(len(data))

        def sink(answer: Header, size: int) -> list[memoryview] | None:
            return [memoryview(head), memoryview(body)] if size == 1 + len(data) else None

        _, got = call("echo", {}, data, sink=sink)
        assert got is TAKEN and bytes(head) + bytes(body) == data[100:] + b"|" + data[:100]
        assert b.calls["unary"] == 2
        # malformed unary frames get an error frame back and reach no handler
        raw = a.p2p.peer_id
        for garbage in (b"", b"\xff" * 11, (5).to_bytes(4, "little") + b"[1,2]" + (0).to_bytes(8, "little")):
            data_back = b.run(
                b.p2p._client.call_unary_handler(raw, "grow" + UNARY_SUFFIX, garbage), timeout_s=30
            )
            assert b'"error"' in data_back and len(served) == 5
        # a peer that serves a handler over streams only (an older version): the call falls back
        a.run(a.p2p._client.remove_unary_handler("grow" + UNARY_SUFFIX), timeout_s=30)
        _, answer = call("grow", {"n": 512}, b"w")
        assert bytes(answer) == bytes(range(256)) * 2 and served[5:] == [1]
        assert b.calls == {"unary": 2, "stream": 4}
    finally:
        b.shutdown()
        a.shutdown()
