"""Frames between two real peers: payloads sent in pieces and read in slices arrive whole and in order.

Large payloads (a 100M-parameter round's parts) are written slice by slice and read into one buffer
allocated up front; small ones in one go. Both must give back exactly the bytes sent, whatever the
pieces, and count the same bytes on both sides.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import numpy as np
import pytest

from collab.swarm.transport import (
    IO_SLICE,
    LINK,
    LINK_MAX_BYTES,
    LINKS_PER_PEER,
    TAKEN,
    Header,
    Payloads,
    Received,
    SwarmNode,
    _frame_bytes,
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
def test_small_frames_go_over_the_link_and_everything_else_over_a_stream() -> None:
    """Small frames take the link between two peers, many at once; a large request, a large answer
    (asked again over a stream), a peer without links, a broken link and malformed envelopes all end
    well."""
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    served: list[int] = []

    async def grow(header: Header, payload: Received, remote: str) -> tuple[Header, Payloads]:
        served.append(len(payload))
        await asyncio.sleep(header.get("sleep", 0.0))
        return {"n": header["n"]}, bytes(range(256)) * (header["n"] // 256)

    try:
        a.serve("grow", grow)
        a.serve("echo", _echo)

        def call(name: str, header: Header, payload: Payloads = b"", **kw: Any) -> tuple[Header, Received]:
            return b.run(b.call(a.peer_key, name, header, payload, timeout_s=30, **kw), timeout_s=60)

        _, answer = call("grow", {"n": 1024}, b"x" * 100)
        assert bytes(answer) == bytes(range(256)) * 4 and served == [100]
        assert b.calls == {"link": 1}
        assert b.bytes_sent == a.bytes_received and a.bytes_sent == b.bytes_received

        # calls at once on one link: each answer to its own call, as soon as it is ready
        async def both() -> tuple[list[str], list[tuple[Header, Received]]]:
            done: list[str] = []

            async def one(name: str, header: Header) -> tuple[Header, Received]:
                got = await b.call(a.peer_key, "grow", header, name[:1].encode(), timeout_s=30)
                done.append(name)
                return got

            got = await asyncio.gather(one("slow", {"n": 256, "sleep": 0.5}), one("quick", {"n": 512}))
            return done, list(got)

        order, [(h1, slow), (h2, quick)] = b.run(both(), timeout_s=60)
        assert (h1["n"], len(slow), h2["n"], len(quick)) == (256, 256, 512, 512)
        assert order == ["quick", "slow"]  # not queued behind the slow one
        assert served[1:] == [1, 1] and b.calls == {"link": 3}
        # a large answer to a small request: it says so, and the call goes again over a stream
        _, answer = call("grow", {"n": 2 * LINK_MAX_BYTES}, b"y")
        assert len(answer) == 2 * LINK_MAX_BYTES and served[3:] == [1, 1]
        assert b.calls == {"link": 3, "stream": 1}
        # a large request goes over a stream at once; so does one whose caller asks for it
        call("grow", {"n": 256}, b"z" * LINK_MAX_BYTES)
        call("grow", {"n": 256}, b"z", link=False)
        assert b.calls == {"link": 3, "stream": 3} and served[5:] == [LINK_MAX_BYTES, 1]
        # a small answer through the caller's sink
        data = bytes(range(200))
        head, body = bytearray(1), bytearray(len(data))

        def sink(answer: Header, size: int) -> list[memoryview] | None:
            return [memoryview(head), memoryview(body)] if size == 1 + len(data) else None

        _, got = call("echo", {}, data, sink=sink)
        assert got is TAKEN and bytes(head) + bytes(body) == data[100:] + b"|" + data[:100]
        assert b.calls["link"] == 4
        # (a stream's server counts what it sent once its write returned: the caller may be quicker)
        for _ in range(100):
            if a.bytes_sent == b.bytes_received:
                break
            time.sleep(0.05)
        assert b.bytes_sent == a.bytes_received and a.bytes_sent == b.bytes_received
        # a link that breaks: the next call opens another
        b.run(_break_links(b), timeout_s=10)
        _, answer = call("grow", {"n": 256}, b"v")
        assert len(answer) == 256 and b.calls["link"] == 5 and served[7:] == [1]

        # malformed envelopes and frames: an error for a bad frame, the link closed for a bad envelope;
        # no handler reached either way
        async def raw(envelope_header: Header, frame: bytes) -> bytes:
            _, reader, writer = await b.p2p.call_binary_stream_handler(a.peer_id, LINK)
            try:
                writer.write(_frame_bytes(envelope_header, frame))
                await writer.drain()
                return await asyncio.wait_for(reader.read(1 << 16), 10)
            finally:
                writer.close()

        for garbage in (b"", b"\xff" * 11, (5).to_bytes(4, "little") + b"[1,2]" + (0).to_bytes(8, "little")):
            assert b'"error"' in b.run(raw({"id": 7, "to": "grow"}, garbage), timeout_s=30)
        assert b'"error"' in b.run(raw({"id": 8, "to": "nothing"}, _frame_bytes({}, b"")), timeout_s=30)
        for envelope in ({"id": "7", "to": "grow"}, {"to": "grow"}, {"id": 1, "to": 5}):
            assert b.run(raw(envelope, _frame_bytes({"n": 256}, b"")), timeout_s=30) == b""  # closed
        assert len(served) == 8
    finally:
        b.shutdown()
        a.shutdown()


@pytest.mark.timeout(120)
def test_a_peer_without_links_is_called_over_streams() -> None:
    """A peer that serves its handlers over streams only (an older version) still answers every call."""
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    try:
        a.serve("echo", _echo)
        a.run(a.p2p.remove_binary_stream_handler(LINK), timeout_s=30)
        header, answer = b.run(b.call(a.peer_key, "echo", {}, b"abcd", timeout_s=30), timeout_s=60)
        assert header["sha"] == hashlib.sha256(b"abcd").hexdigest() and bytes(answer) == b"cd|ab"
        assert b.calls == {"stream": 1}
    finally:
        b.shutdown()
        a.shutdown()


async def _break_links(node: SwarmNode) -> None:
    for link in list(node._links.values()):
        link.writer.close()
    await asyncio.sleep(0.2)


@pytest.mark.timeout(120)
def test_links_are_bounded_per_peer_and_a_malformed_answer_breaks_only_its_link() -> None:
    """A peer gets at most LINKS_PER_PEER links; a link that answers with a malformed envelope is
    dropped at once and the call still gets its answer (over a stream), not a timeout."""
    a = SwarmNode()
    b = SwarmNode(initial_peers=a.visible_maddrs())
    try:
        a.serve("echo", _echo)

        async def open_links(n: int) -> list[bytes]:
            streams = [await b.p2p.call_binary_stream_handler(a.peer_id, LINK) for _ in range(n)]

            async def use(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
                try:  # one call each, so every link is in use
                    writer.write(_frame_bytes({"id": 1, "to": "echo"}, _frame_bytes({}, b"ab")))
                    await writer.drain()
                    return await asyncio.wait_for(reader.read(1 << 16), 10)
                except ConnectionError:  # the refused one may be reset before our call is out
                    return b""

            try:
                return list(await asyncio.gather(*(use(r, w) for _, r, w in streams)))
            finally:
                for _, _, writer in streams:
                    writer.close()

        answers = b.run(open_links(LINKS_PER_PEER + 1), timeout_s=60)
        # (which one is refused depends on the order in which they reach the peer)
        assert sum(b'"sha"' in x for x in answers) == LINKS_PER_PEER and answers.count(b"") == 1

        async def bad_link(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 16)
            writer.write(_frame_bytes({"id": [0]}, _frame_bytes({"sha": "forged"}, b"")))
            await writer.drain()
            await asyncio.sleep(30)

        a.run(a.p2p.remove_binary_stream_handler(LINK), timeout_s=30)
        a.run(a.p2p.add_binary_stream_handler(LINK, bad_link), timeout_s=30)
        started = time.monotonic()
        header, answer = b.run(b.call(a.peer_key, "echo", {}, b"abcd", timeout_s=20), timeout_s=60)
        assert header["sha"] == hashlib.sha256(b"abcd").hexdigest() and bytes(answer) == b"cd|ab"
        assert b.calls == {"stream": 1} and time.monotonic() - started < 10
    finally:
        b.shutdown()
        a.shutdown()
