"""SwarmNode: a hivemind DHT node plus request/response calls between peers over its libp2p daemon.

The only module that starts hivemind processes. A node runs the DHT (its own process and ``p2pd``), an
asyncio loop in a background thread, and a replica of the DHT's P2P client in this process, on which
collab registers its handlers. Every message is one frame each way::

    u32 header_len | header (UTF-8 JSON object) | u64 payload_len | payload

with hard limits on both lengths (a frame over the limit is refused before it is read). Bytes of every
frame sent and received are counted: these are the "wire bytes" of the accounting (DHT traffic, which
runs in the DHT's own process, is not included).

A frame travels one of two ways. A small one (both ways under :data:`LINK_MAX_BYTES`) goes over the
*link* to its peer: one long-lived libp2p stream per pair of peers, opened by the caller on its first
call, on which calls and their answers travel as envelopes (``{"id": n, "to": handler}`` + the frame)
and are matched by id, many at once. A round's small messages then cost neither a libp2p stream nor
new sockets between a process and its ``p2pd``: measured (echo of 300 bytes, both processes and both
daemons), 0.3-0.4 ms of CPU per call against 1.0 ms for p2pd's unary calls and 2.4 ms for a stream per
call. A larger frame, or one whose answer turns out larger, goes over a libp2p stream of its own, read
and written in slices. Each handler answers both ways alike.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import base58
import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from collab.swarm.access import Access, AccessDenied

logger = logging.getLogger(__name__)

T = TypeVar("T")
Header = dict[str, Any]
Payload = bytes | bytearray | memoryview  # what a frame carries (sent as is: no copy to frame it)
Payloads = Payload | Sequence[Payload]  # one payload, or its pieces in order
Received = bytes | memoryview  # a payload as read (large ones: a writable buffer)
Handler = Callable[[Header, Received, str], Awaitable[tuple[Header, Payloads]]]
# where a caller wants an answer's payload: given the answer's header and payload size, the buffers to
# fill in order (sizes summing to the payload's), or None for a buffer of the transport's own
Sink = Callable[[Header, int], Sequence[memoryview] | None]
TAKEN = memoryview(b"")  # returned for a payload that went into the call's sink (compare with ``is``)

# Bumped whenever peers of two versions could not complete a round together (3: BLAKE3 part digests
# and state chunk digests; 4: small rounds through one owner; 5: statements and lists signed with the
# peer's identity key; 6: small frames over one link per pair of peers); matchmaking keeps peers of
# different protocols out of each other's groups.
WIRE_PROTOCOL = 6
MAX_HEADER_BYTES = 64 * 1024
IO_SLICE = 1 << 20  # large payloads are written and read in slices of this many bytes (at most)
BOOTSTRAP_ATTEMPTS = 3  # initial peers that miss a ping (busy, starting) get two more chances
LINK = "collab.link"  # the stream handler of links (see the module's docs)
LINK_MAX_BYTES = 1 << 20  # frames this large or larger go over a stream of their own, not the link
LINK_IN_FLIGHT = 256  # calls one link may have in this node's handlers at once (more wait to be read)
LINK_IN_FLIGHT_BYTES = 16 * 1024**2  # and their frames' bytes
LINKS_PER_PEER = 4  # links a peer may hold open to this node (it opens one; more while one is replaced)
LINK_BUFFER_BYTES = 4 * 1024**2  # calls a peer has not read this much of: its link is dropped
LINK_IDLE_S = 120.0  # a link with no call for this long is closed (the next call opens another)
NO_LINK_S = 30.0  # a peer whose new link broke off before any answer is called over streams this long
_TOO_LARGE = "too-large-for-link"  # a linked answer's header key: ask again over a stream


class TransportError(RuntimeError):
    """A call to a peer failed: unreachable, refused, timed out, or a malformed answer."""


class RemoteError(TransportError):
    """The peer answered with an error."""


class _BrokenOff(TransportError):
    """The stream closed before a single byte of the answer: safe to retry an idempotent call."""


async def _read_header(reader: asyncio.StreamReader) -> tuple[Header, int, int]:
    """A frame's header, the header's length and the payload's length (the payload is not read yet)."""
    head_len = int.from_bytes(await reader.readexactly(4), "little")
    if head_len > MAX_HEADER_BYTES:
        raise TransportError(f"frame header of {head_len} bytes exceeds {MAX_HEADER_BYTES}")
    header = _decode_header(await reader.readexactly(head_len))
    return header, head_len, int.from_bytes(await reader.readexactly(8), "little")


def _decode_header(raw: bytes) -> Header:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deeply
        raise TransportError("frame header is not valid JSON") from None
    if not isinstance(header, dict):
        raise TransportError("frame header is not a JSON object")
    return header


async def _read_payload(reader: asyncio.StreamReader, size: int) -> Received:
    """The next ``size`` bytes. A large payload is read piece by piece into one buffer allocated up front
    (writable: a receiver may keep views of it): never a stream buffer grown to the payload's size and
    then copied out whole. The buffer is anonymous memory that the kernel provides page by page as the
    bytes land: a peer that announces a large payload and sends nothing holds no memory with it."""
    if size <= IO_SLICE:
        return await reader.readexactly(size) if size else b""
    try:
        out = memoryview(mmap.mmap(-1, size))
    except (OSError, ValueError, OverflowError, MemoryError) as e:
        raise TransportError(f"cannot hold a payload of {size} bytes: {e}") from None
    await _fill(reader, [out])
    return out


async def _fill(reader: asyncio.StreamReader, views: Sequence[memoryview]) -> None:
    """Read the next bytes into ``views``, one after the other, until all are full."""
    done = 0
    for view in views:
        pos = 0
        while pos < view.nbytes:
            piece = await reader.read(min(view.nbytes - pos, IO_SLICE))
            if not piece:  # broken off in the payload: not a call to retry (bytes of the answer came)
                raise TransportError(f"the stream broke off after {done + pos} bytes of the payload")
            view[pos : pos + len(piece)] = piece
            pos += len(piece)
        done += view.nbytes


async def _read_frame(
    reader: asyncio.StreamReader, max_payload: int, sink: Sink | None = None
) -> tuple[Header, Received, int]:
    """A frame; with ``sink`` its payload may go into the caller's buffers (then :data:`TAKEN` is
    returned in its place)."""
    header, head_len, size = await _read_header(reader)
    if size > max_payload:
        raise TransportError(f"payload of {size} bytes exceeds the limit of {max_payload}")
    views = sink(header, size) if sink is not None and size else None
    if views is not None and sum(v.nbytes for v in views) == size:
        await _fill(reader, [v.cast("B") for v in views])
        return header, TAKEN, 12 + head_len + size
    return header, await _read_payload(reader, size), 12 + head_len + size


_DRAIN_FACTOR = 8
HEADER_READ_TIMEOUT_S = 30.0  # a stream that does not send its header by then is dropped


def _payload_timeout(size: int) -> float:
    """Time allowed to receive ``size`` bytes: generous (1 MB/s), but a stalled sender is dropped."""
    return 30.0 + size / 1e6


async def _discard(reader: asyncio.StreamReader, size: int) -> None:
    while size > 0:
        chunk = await reader.read(min(size, 1 << 20))
        if not chunk:
            return
        size -= len(chunk)


def _frame_head(header: Header, payload_len: int) -> bytes:
    """A frame's bytes before its payload (the payload is written after it, as it is)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return len(head).to_bytes(4, "little") + head + payload_len.to_bytes(8, "little")


def _frame_bytes(header: Header, payload: Payloads) -> bytes:
    """One whole frame as bytes (a small one, for the link: the copy is cheap, and the frame is written
    at once, so a call cancelled while its frame waits in the buffer leaves the link whole)."""
    pieces = [memoryview(p).cast("B") for p in pieces_of(payload)]
    return b"".join([_frame_head(header, sum(p.nbytes for p in pieces)), *pieces])


def _parse_frame(data: bytes, max_payload: int) -> tuple[Header, bytes]:
    """The header and payload of a frame held whole in ``data`` (the same limits as a stream's)."""
    if len(data) < 12:
        raise TransportError(f"a frame of {len(data)} bytes is too short")
    head_len = int.from_bytes(data[:4], "little")
    if head_len > MAX_HEADER_BYTES or 12 + head_len > len(data):
        raise TransportError(f"frame header of {head_len} bytes does not fit its frame")
    header = _decode_header(data[4 : 4 + head_len])
    size = int.from_bytes(data[4 + head_len : 12 + head_len], "little")
    if size > max_payload:
        raise TransportError(f"payload of {size} bytes exceeds the limit of {max_payload}")
    if 12 + head_len + size != len(data):
        raise TransportError(f"frame says {size} bytes of payload, holds {len(data) - 12 - head_len}")
    return header, data[12 + head_len :]


def pieces_of(payload: Payloads) -> Sequence[Payload]:
    """A payload's pieces in order (one payload is one piece)."""
    return [payload] if isinstance(payload, Payload) else payload


async def _send_frame(writer: asyncio.StreamWriter, header: Header, payload: Payloads) -> int:
    """Write one frame and drain it; returns its length. ``payload`` may be several pieces, sent one after
    the other (never joined into a copy), and large pieces go out in slices: the transport copies what
    the socket does not take at once into its buffer, so a whole payload written at once would be copied
    whole."""
    pieces = [memoryview(p).cast("B") for p in pieces_of(payload)]
    size = sum(p.nbytes for p in pieces)
    head = _frame_head(header, size)
    writer.write(head)
    for piece in pieces:
        for lo in range(0, piece.nbytes, IO_SLICE):
            writer.write(piece[lo : lo + IO_SLICE])
            await writer.drain()
    await writer.drain()
    return len(head) + size


class _Link:
    """The caller's end of a link: its stream, the calls waiting for answers (by id), the next id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.pending: dict[int, asyncio.Future[bytes]] = {}
        self.next_id = 0
        self.answers = 0  # answers that came over it
        self.closed = False
        self.reader_task: asyncio.Future[None] | None = None


class SwarmNode:
    """One peer's presence in the swarm.

    Example::

        node = SwarmNode(initial_peers=["/ip4/127.0.0.1/tcp/4100/p2p/12D3..."])
        node.serve("echo", handler)
        header, payload = node.run(node.call(other_peer, "echo", {}, b"hi", timeout_s=5.0), timeout_s=10)
        node.shutdown()
    """

    def __init__(
        self,
        *,
        initial_peers: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        client_mode: bool = False,
        auto_relay: bool = False,
        identity_path: str | None = None,
        max_message_bytes: int = 512 * 1024**2,
        start_timeout_s: float = 60.0,
        record_validators: Sequence[Any] = (),
        access: Access | None = None,
        ensure_bootstrap_success: bool = True,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.client_mode = client_mode
        self.access = access
        self._spawned: set[Any] = set()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.calls: collections.Counter[str] = collections.Counter()  # calls made, by way ("link", "stream")
        self._small: dict[str, Callable[[bytes, str], Awaitable[bytes]]] = {}  # the handlers, for the link
        self._links: dict[str, _Link] = {}  # peer key -> the link this node opened to it
        self._opening: dict[str, asyncio.Lock] = {}  # one link opened at a time per peer
        self._no_link: dict[str, float] = {}  # peer key -> time.monotonic() until which it gets streams
        self._served_links: collections.Counter[str] = collections.Counter()  # links open to us, by peer
        kwargs: dict[str, Any] = {}
        # The libp2p identity is an Ed25519 key this process holds: a peer id then names its public key,
        # so what a peer signs with :attr:`identity` anyone can check against its id (see agreement.py).
        fresh_dir: str | None = None
        if identity_path:
            _ensure_identity(identity_path)
        else:  # a fresh identity, handed to p2pd in a private file that is removed once it started
            fresh_dir = tempfile.mkdtemp(prefix="collab-id-")
            identity_path = os.path.join(fresh_dir, "identity.key")
            write_identity(identity_path, Ed25519PrivateKey.generate())
            kwargs["check_if_identity_free"] = False  # a key made just now: nobody else holds it
        self.identity: Ed25519PrivateKey | None = read_identity(identity_path)
        kwargs["identity_path"] = identity_path
        if auto_relay:  # libp2p looks for relays through which others can reach this peer (behind NAT)
            kwargs["use_auto_relay"] = True
        if access is not None:  # every DHT request signed with our token, every incoming one checked
            kwargs["authorizer"] = access.authorizer
        try:
            for attempt in range(BOOTSTRAP_ATTEMPTS):
                try:
                    self.dht = hivemind.DHT(
                        initial_peers=list(initial_peers),
                        # a client (behind NAT) listens nowhere: it dials out, and only the peers it dialed
                        # can reach it, over that connection
                        host_maddrs=[] if client_mode else [f"/ip4/{host}/tcp/{port}"],
                        no_listen=client_mode,
                        client_mode=client_mode,
                        record_validators=list(record_validators),
                        ensure_bootstrap_success=ensure_bootstrap_success,
                        start=True,
                        await_ready=True,
                        **kwargs,
                    )
                    break
                except Exception as e:  # a busy peer may miss a ping: try again before giving up
                    if "bootstrap failed" not in str(e) or attempt == BOOTSTRAP_ATTEMPTS - 1:
                        raise
                    logger.warning("joining the DHT failed (%s); retrying", e)
                    time.sleep(2.0 * (attempt + 1))
        finally:  # p2pd has read it (or will never start): the key lives on in this process only
            if fresh_dir is not None:
                _remove_fresh_identity(fresh_dir)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="collab-swarm", daemon=True)
        self._thread.start()
        try:
            self.p2p = self.run(self.dht.replicate_p2p(), timeout_s=start_timeout_s)
            self.peer_id: PeerID = self.p2p.peer_id
            self.peer_key: str = self.peer_id.to_base58()
            self.run(self.p2p.add_binary_stream_handler(LINK, self._serve_link), timeout_s=30.0)
        except BaseException:
            self.shutdown()
            raise
        self._signer = access.signer() if access is not None else None
        self._verifier = access.verifier(self.peer_key) if access is not None else None
        self._closed = False

    # ---- running coroutines from synchronous code -------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T] | Awaitable[T], *, timeout_s: float) -> T:
        """Run ``coro`` on the node's loop and wait for it (cancelled on timeout)."""
        fut = asyncio.run_coroutine_threadsafe(_as_coroutine(coro), self._loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the node's loop and return its future (cancel it when no longer wanted)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Start ``coro`` on the node's loop without waiting for it (it gets a grace period at shutdown)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._spawned.add(fut)
        fut.add_done_callback(self._spawned.discard)

    # ---- calls ------------------------------------------------------------------------------------
    def serve(
        self,
        name: str,
        handler: Handler,
        *,
        max_payload: int | None = None,
        on_refused: Callable[[Header, str, str], None] | None = None,
    ) -> None:
        """Answer calls named ``name`` with ``handler(header, payload, remote_peer_key)``.

        In an invite-only run the caller's token and signature are checked first (a call without a valid
        one is answered with an error and never reaches the handler). A payload over ``max_payload``
        (default: the node's limit) is refused before it is read; ``on_refused(header, reason, remote)``
        hears of it (the averaging uses that to drop the sender's contribution).
        """
        limit = self.max_message_bytes if max_payload is None else min(max_payload, self.max_message_bytes)

        def refusal_of(header: Header, size: int, remote: str) -> tuple[str | None, bool]:
            """Why a call is refused before its payload is read (or None), and whether its payload may be
            read and dropped (not for strangers: no work for them)."""
            if self._verifier is not None:
                try:
                    self._verifier.precheck(header)
                except AccessDenied as e:
                    return f"unauthorized: {e}", False
            if size > limit:
                refusal = f"payload of {size} bytes exceeds the limit of {limit}"
                if on_refused is not None:
                    on_refused(header, refusal, remote)
                return refusal, True
            return None, True

        async def answer(header: Header, payload: Received, remote: str) -> tuple[Header, Payloads]:
            try:
                if self._verifier is not None:
                    self._verifier.verify(name, header, payload)
                    header = {k: v for k, v in header.items() if k != "auth"}
                return await handler(header, payload, remote)
            except AccessDenied as e:
                return {"error": f"unauthorized: {e}"}, b""
            except Exception as e:  # a bad request is the caller's problem: answer, keep serving
                logger.debug("%s: handler %s failed for %s: %s", self.peer_key[-6:], name, remote[-6:], e)
                return {"error": f"{type(e).__name__}: {e}"}, b""

        def refused(name: str, remote: str, refusal: str) -> tuple[Header, Payloads]:
            logger.info("%s: refused %s from %s: %s", self.peer_key[-6:], name, remote[-6:], refusal)
            return {"error": refusal}, b""

        async def on_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            remote = info.peer_id.to_base58()
            try:
                header, head_len, size = await asyncio.wait_for(_read_header(reader), HEADER_READ_TIMEOUT_S)
                self.bytes_received += 12 + head_len
                refusal, drain = refusal_of(header, size, remote)
                out_payload: Payloads
                if refusal is not None:
                    if drain and size <= _DRAIN_FACTOR * limit:  # read and drop it: the stream stays healthy
                        await asyncio.wait_for(_discard(reader, size), _payload_timeout(size))
                    out_header, out_payload = refused(name, remote, refusal)
                else:
                    payload = await asyncio.wait_for(_read_payload(reader, size), _payload_timeout(size))
                    self.bytes_received += size
                    out_header, out_payload = await answer(header, payload, remote)
                # bounded: a caller that never reads its answer must not hold it (and this task) forever
                out_size = sum(memoryview(p).nbytes for p in pieces_of(out_payload))
                sent = await asyncio.wait_for(
                    _send_frame(writer, out_header, out_payload), _payload_timeout(out_size)
                )
                self.bytes_sent += sent
                # drain() only handed the frame to p2pd: closing now may cut a large answer off on its way
                # (seen: an 8 MiB state chunk broke off after 7 MB). The caller closes once it has read it.
                await asyncio.wait_for(reader.read(1), _payload_timeout(sent))
            except (
                asyncio.IncompleteReadError,
                ConnectionError,
                TransportError,
                ValueError,
                TimeoutError,
            ) as e:
                logger.debug("%s: dropped %s stream from %s: %s", self.peer_key[-6:], name, remote[-6:], e)
            finally:
                writer.close()

        async def small(data: bytes, remote: str) -> bytes:
            """A whole small frame in, a whole frame out (for the link, which counts the bytes)."""
            out_payload: Payloads
            try:
                header, payload = _parse_frame(data, LINK_MAX_BYTES)
            except TransportError as e:
                logger.debug("%s: dropped %s call from %s: %s", self.peer_key[-6:], name, remote[-6:], e)
                out_header, out_payload = {"error": f"malformed frame: {e}"}, b""
            else:
                refusal, _ = refusal_of(header, len(payload), remote)
                if refusal is not None:
                    out_header, out_payload = refused(name, remote, refusal)
                else:
                    out_header, out_payload = await answer(header, payload, remote)
            out_size = sum(memoryview(p).nbytes for p in pieces_of(out_payload))
            frame = _frame_bytes(out_header, out_payload) if out_size < LINK_MAX_BYTES else b""
            if not frame or len(frame) >= LINK_MAX_BYTES:  # the caller asks again over a stream (handlers
                frame = _frame_bytes({_TOO_LARGE: out_size}, b"")  # are idempotent)
            return frame

        self.run(self.p2p.add_binary_stream_handler(name, on_stream), timeout_s=30.0)
        self._small[name] = small

    async def _serve_link(
        self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A link a peer opened to this node: answer its calls, many at once, each as soon as it is done.
        Bounded: ``LINKS_PER_PEER`` links per peer; at most ``LINK_IN_FLIGHT`` calls and
        ``LINK_IN_FLIGHT_BYTES`` of their frames in the handlers at once (more are not read until some
        are answered); an answer the caller does not read in time closes the link."""
        remote = info.peer_id.to_base58()
        if self._served_links[remote] >= LINKS_PER_PEER:
            writer.transport.abort()
            return
        self._served_links[remote] += 1
        running: dict[asyncio.Task[None], int] = {}  # handler task -> its frame's size

        async def one(call_id: int, name: str, frame: bytes) -> None:
            try:
                handler = self._small.get(name)
                if handler is None:
                    out = _frame_bytes({"error": f"no handler {name[:64]!r}"}, b"")
                else:
                    out = await handler(frame, remote)
                del frame
                envelope = _frame_bytes({"id": call_id}, out)
            except Exception as e:  # answered all the same: the caller must not wait out its timeout
                logger.debug("%s: linked %s from %s failed: %s", self.peer_key[-6:], name, remote[-6:], e)
                envelope = _frame_bytes({"id": call_id}, _frame_bytes({"error": f"{type(e).__name__}"}, b""))
            if writer.is_closing():
                return
            self.bytes_sent += len(envelope)  # counted first: the caller may read it before the next line
            writer.write(envelope)  # whole: answers of concurrent calls never interleave
            try:
                await asyncio.wait_for(writer.drain(), _payload_timeout(len(envelope)))
            except (ConnectionError, TimeoutError):  # a caller that does not read loses its link
                writer.transport.abort()

        try:
            while True:
                try:
                    head, head_len, size = await asyncio.wait_for(_read_header(reader), 2 * LINK_IDLE_S)
                except TimeoutError:
                    if running:  # not idle: its calls are still being answered
                        continue
                    raise
                call_id, name = head.get("id"), head.get("to")
                if type(call_id) is not int or not isinstance(name, str) or size >= LINK_MAX_BYTES + 4096:
                    raise TransportError("malformed link envelope")
                frame = await asyncio.wait_for(_read_payload(reader, size), _payload_timeout(size))
                self.bytes_received += 12 + head_len + size
                task = asyncio.ensure_future(one(call_id, name, bytes(frame)))
                del frame
                running[task] = size
                task.add_done_callback(running.pop)
                # full: read no more of this link until a call is answered
                while len(running) >= LINK_IN_FLIGHT or sum(running.values()) >= LINK_IN_FLIGHT_BYTES:
                    await asyncio.wait(list(running), return_when=asyncio.FIRST_COMPLETED)
        except (asyncio.IncompleteReadError, ConnectionError, TransportError, ValueError, TimeoutError) as e:
            logger.debug("%s: closed the link from %s: %s", self.peer_key[-6:], remote[-6:], e)
        finally:
            self._served_links[remote] -= 1
            if self._served_links[remote] <= 0:
                del self._served_links[remote]
            for task in list(running):
                task.cancel()
            writer.transport.abort()  # close() would wait for a caller that may never read

    async def call(
        self,
        peer_key: str,
        name: str,
        header: Header,
        payload: Payloads = b"",
        *,
        timeout_s: float,
        retries: int = 3,
        sink: Sink | None = None,
        link: bool = True,
    ) -> tuple[Header, Received]:
        """Send one frame to ``peer_key``'s handler ``name`` and return its answer frame.

        A stream that breaks off before any answer byte arrives is retried (``retries`` times): libp2p
        sometimes resets streams when it replaces a duplicate connection between two peers. Every handler
        collab serves is idempotent, so a repeated request is harmless. With ``sink``, an answer whose
        payload the sink takes is read straight into the sink's buffers and returned as :data:`TAKEN`
        (the buffers may hold a partial answer when the call fails; every try asks the sink again).
        A small frame goes over the link to the peer (see the module's docs); ``link=False`` when the
        answer is expected to be large (it would come back "too large" and be asked for again over a
        stream).
        """
        deadline = time.monotonic() + timeout_s
        for attempt in range(retries + 1):
            remaining = deadline - time.monotonic()
            try:
                return await asyncio.wait_for(
                    self._call(peer_key, name, header, payload, sink, link), max(0.01, remaining)
                )
            except TimeoutError:
                raise TransportError(
                    f"call {name} to {peer_key[-6:]} timed out after {timeout_s:.1f}s"
                ) from None
            except _BrokenOff as e:
                if attempt == retries or time.monotonic() >= deadline:
                    raise TransportError(str(e)) from None
                logger.debug("%s: %s; retrying", self.peer_key[-6:], e)
                await asyncio.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")

    async def _call(
        self, peer_key: str, name: str, header: Header, payload: Payloads, sink: Sink | None, link: bool
    ) -> tuple[Header, Received]:
        if link and sum(memoryview(p).nbytes for p in pieces_of(payload)) < LINK_MAX_BYTES:
            answered = await self._linked_call(peer_key, name, header, payload, sink)
            if answered is not None:
                self.calls["link"] += 1
                return answered
        self.calls["stream"] += 1
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_key), name)
        except Exception as e:  # p2pd reports unreachable peers with several exception types
            raise TransportError(f"cannot reach {peer_key[-6:]} for {name}: {e}") from None
        try:
            if self._signer is not None:
                header = self._signer.sign(name, peer_key, header, payload)
            sent = await _send_frame(writer, header, payload)
            self.bytes_sent += sent
            out_header, out_payload, n = await _read_frame(reader, self.max_message_bytes, sink)
            self.bytes_received += n
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise _BrokenOff(f"call {name} to {peer_key[-6:]} broke off before any answer") from None
            raise TransportError(f"call {name} to {peer_key[-6:]} broke off: {e!r}") from None
        except ConnectionError as e:
            raise _BrokenOff(f"call {name} to {peer_key[-6:]} broke off: {e!r}") from None
        except json.JSONDecodeError as e:
            raise TransportError(f"call {name} to {peer_key[-6:]} sent a malformed answer: {e}") from None
        finally:
            writer.close()
        if "error" in out_header:
            raise RemoteError(f"{peer_key[-6:]} refused {name}: {out_header['error']}")
        return out_header, out_payload

    async def _link_to(self, peer_key: str) -> _Link:
        """The open link to ``peer_key`` (opened now if there is none)."""
        link = self._links.get(peer_key)
        if link is not None and not link.closed:
            return link
        async with self._opening.setdefault(peer_key, asyncio.Lock()):
            link = self._links.get(peer_key)
            if link is None or link.closed:
                _, reader, writer = await self.p2p.call_binary_stream_handler(
                    PeerID.from_base58(peer_key), LINK
                )
                link = self._links[peer_key] = _Link(reader, writer)
                link.reader_task = asyncio.ensure_future(self._read_link(peer_key, link))
            return link

    async def _read_link(self, peer_key: str, link: _Link) -> None:
        """Hand each answer that comes over ``link`` to its call; when the link breaks (or idles with no
        call waiting), fail every call still waiting on it (they may be asked again: handlers are
        idempotent)."""
        reason = f"the link to {peer_key[-6:]} closed"
        try:
            while True:
                try:
                    head, head_len, size = await asyncio.wait_for(_read_header(link.reader), LINK_IDLE_S)
                except TimeoutError:
                    if link.pending:
                        continue
                    raise
                if size >= LINK_MAX_BYTES + 4096 or type(head.get("id")) is not int:
                    raise TransportError(f"a malformed linked answer ({size} bytes)")
                data = await asyncio.wait_for(_read_payload(link.reader, size), _payload_timeout(size))
                self.bytes_received += 12 + head_len + size
                link.answers += 1
                waiting = link.pending.pop(head["id"], None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(bytes(data))
        except (asyncio.IncompleteReadError, ConnectionError, TransportError, ValueError, TimeoutError) as e:
            reason = f"the link to {peer_key[-6:]} broke off: {e!r}"
        finally:
            link.closed = True
            if self._links.get(peer_key) is link:
                del self._links[peer_key]
            link.writer.transport.abort()
            for waiting in link.pending.values():
                if not waiting.done():
                    waiting.set_exception(_BrokenOff(reason))
            link.pending.clear()

    async def _linked_call(
        self, peer_key: str, name: str, header: Header, payload: Payloads, sink: Sink | None
    ) -> tuple[Header, Received] | None:
        """The call over the link to ``peer_key``; ``None`` when it must go over a stream instead (the
        frame or its answer too large, or no link could be opened: the stream says whether the peer is
        reachable at all)."""
        if self._no_link.get(peer_key, 0.0) > time.monotonic():
            return None
        if self._signer is not None:
            header = self._signer.sign(name, peer_key, header, payload)
        frame = _frame_bytes(header, payload)
        if len(frame) >= LINK_MAX_BYTES:
            return None
        try:
            link = await self._link_to(peer_key)
        except Exception as e:  # p2pd reports an unreachable peer, or one without links, in several ways
            logger.debug("%s: no link to %s (%s): over a stream", self.peer_key[-6:], peer_key[-6:], e)
            return None
        call_id, link.next_id = link.next_id, link.next_id + 1
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        link.pending[call_id] = answer
        envelope = _frame_bytes({"id": call_id, "to": name}, frame)
        try:
            if link.writer.transport.get_write_buffer_size() > LINK_BUFFER_BYTES:  # the peer reads nothing
                link.writer.transport.abort()
                raise ConnectionError(f"{LINK_BUFFER_BYTES} bytes of calls unread")
            link.writer.write(envelope)  # whole, at once: a cancelled call leaves the link intact
            self.bytes_sent += len(envelope)
            await link.writer.drain()
            data = await answer
        except (ConnectionError, _BrokenOff) as e:
            if link.answers == 0:  # libp2p opens a stream before the peer accepts it: one that serves no
                # links (an older version) closes it unread. Streams serve that peer for a while.
                logger.debug("%s: link to %s unanswered (%s): streams", self.peer_key[-6:], peer_key[-6:], e)
                self._no_link[peer_key] = time.monotonic() + NO_LINK_S
                return None
            raise _BrokenOff(f"the link to {peer_key[-6:]} broke off: {e!r}") from None
        finally:
            link.pending.pop(call_id, None)
        out_header, out_payload = _parse_frame(data, self.max_message_bytes)
        if _TOO_LARGE in out_header:
            return None
        if "error" in out_header:
            raise RemoteError(f"{peer_key[-6:]} refused {name}: {out_header['error']}")
        views = sink(out_header, len(out_payload)) if sink is not None and out_payload else None
        if views is not None and sum(v.nbytes for v in views) == len(out_payload):
            pos = 0
            for v in views:
                flat = v.cast("B")
                flat[:] = out_payload[pos : pos + flat.nbytes]
                pos += flat.nbytes
            return out_header, TAKEN
        return out_header, out_payload

    # ---- DHT --------------------------------------------------------------------------------------
    async def dht_store(self, key: str, subkey: str | bytes, value: Any, expiration_time: float) -> bool:
        return bool(await self.dht.store(key, value, expiration_time, subkey=subkey, return_future=True))

    async def dht_get_dict(self, key: str) -> dict[str, Any]:
        """``{subkey: value}`` of a dictionary key (empty if absent or expired)."""
        found = await self.dht.get(key, latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(sub): item.value for sub, item in found.value.items()}

    def get_dict(self, key: str, *, timeout_s: float) -> dict[str, Any]:
        """Blocking :meth:`dht_get_dict`."""
        return self.run(self.dht_get_dict(key), timeout_s=timeout_s)

    def visible_maddrs(self) -> list[str]:
        """The addresses other peers can dial this one at (none for a client: it listens nowhere)."""
        if self.client_mode:
            return []
        return [str(a) for a in self.dht.get_visible_maddrs()]

    # ---- shutdown ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the P2P replica, the loop and the DHT process (and with it ``p2pd``)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        deadline = time.monotonic() + 2.0
        for fut in list(self._spawned):  # e.g. a last progress record on its way to the DHT
            with contextlib.suppress(Exception):
                fut.result(max(0.0, deadline - time.monotonic()))
        if hasattr(self, "p2p"):
            try:
                self.run(self.p2p.shutdown(), timeout_s=10.0)
            except Exception as e:  # shutting down: report, carry on
                logger.debug("p2p replica shutdown: %s", e)
        with contextlib.suppress(Exception):
            self.run(_cancel_pending(), timeout_s=5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)
        self.dht.shutdown()


# A peer id of an Ed25519 key: the identity multihash (0x00, length 36) of the key's protobuf
# (key type 1, 32 bytes of key): the key is in the id itself.
_ED25519_PEER_ID = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
MAX_PEER_KEY_CHARS = 128  # an Ed25519 peer id is 52 characters of base58


def write_identity(path: str, key: Ed25519PrivateKey) -> str:
    """Write ``key`` as a libp2p identity file (readable by its owner only; created, never overwritten)
    and return the peer key (base58 peer id) it gives."""
    seed = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + public).SerializeToString()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    return base58.b58encode(_ED25519_PEER_ID + public).decode()


def read_identity(path: str) -> Ed25519PrivateKey | None:
    """The Ed25519 key of a libp2p identity file (``None`` for another kind of key, e.g. an RSA identity
    made by an older version: such a peer can serve the DHT, not sign its part of a round)."""
    pb = crypto_pb2.PrivateKey()
    try:
        pb.ParseFromString(Path(path).read_bytes())
    except DecodeError:  # not ours to judge: p2pd says what is wrong with it
        return None
    if pb.key_type != crypto_pb2.KeyType.Ed25519 or len(pb.data) < 32:
        return None
    return Ed25519PrivateKey.from_private_bytes(pb.data[:32])


def peer_public_key(peer_key: str) -> str | None:
    """The Ed25519 public key (hex) that the peer id ``peer_key`` names, or ``None`` when it names
    another kind of key. A libp2p stream from ``peer_key`` proves the remote holds that key's secret."""
    if len(peer_key) > MAX_PEER_KEY_CHARS:  # base58 decoding is quadratic: judge the length first
        return None
    try:
        raw = base58.b58decode(peer_key)
    except ValueError:
        return None
    if len(raw) != len(_ED25519_PEER_ID) + 32 or not raw.startswith(_ED25519_PEER_ID):
        return None
    if base58.b58encode(raw).decode() != peer_key:  # one spelling per key (the decoder skips spaces)
        return None
    return raw[len(_ED25519_PEER_ID) :].hex()


def _remove_fresh_identity(directory: str) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(directory)


def _ensure_identity(path: str) -> None:
    """Create the libp2p identity file (an Ed25519 key) atomically, unless it exists: a crash while
    writing in place would leave a truncated key that no later start could read."""
    target = Path(path)
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    write_identity(str(tmp), Ed25519PrivateKey.generate())
    os.replace(tmp, target)


async def gather_all(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` concurrently and return their results in order; if one fails (or the caller is
    cancelled), cancel the others and raise."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


async def _as_coroutine(aw: Awaitable[T]) -> T:
    return await aw


async def _cancel_pending() -> None:
    """Cancel every other task on the loop and let them finish (no "task destroyed" at exit)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
