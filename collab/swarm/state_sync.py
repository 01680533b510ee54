"""Downloading a peer's replicated state, checked before anyone uses it.

Knows the ``collab.state`` call and :class:`MethodState`; nothing of training. Used by volunteers that
fall behind or join late (``Volunteer.sync``) and by peers that follow a run without training (the model
keeper, ``collab generate --coordinator``). A download is accepted only when the answer names this run's
config version and method and the state's own sha256 equals the hash the peer announced; anything else
is a :class:`StateRejected` with one line that says why, and the caller tries another peer.

**Chunks.** A state moves in chunks (``state_chunk_bytes``), one call each, so no message holds a whole
large state and a slow link makes progress call by call. The first answer (the *manifest*) names the
state's hash, its size and a digest per chunk, and carries the first chunk; the server keeps that
serialization (:class:`Snapshots`) so later chunk calls read the same bytes while it trains on. Every chunk
is checked against its digest as it arrives. A download that breaks off keeps what it has
(:class:`Partial`) and resumes from the next chunk, from the same or any other peer whose manifest names
the same state (the serialization is deterministic, so equal states give equal chunks); the whole
state's hash is checked at the end as before.

**Vouches.** The hash only proves that the bytes are what the source meant to send. A state is adopted
only when more than one member of the run vouches for it (:class:`Vouches`): every volunteer's progress
record, signed with its key, lists the latest (step, state hash) pairs its groups committed, and a
committed group has at least two members, so an honest state is vouched for by the keys of its source and
of a fellow member of the group that made it. A state fewer than two keys vouch for within
``Timing.vouch_wait_s`` is rejected; one whose step other keys vouch for with another hash, and at most
one key for its own, is forged (:class:`ForgedState`: its source is banned). Only when no other peer of
the run is alive (or the run allows groups of one) is the source's word taken alone. A forger that holds
two keys (two tokens of an invite-only run, or two identities of an open one) is not caught this way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import blake3
import torch

from collab.methods.base import MethodState, StreamHash
from collab.swarm.records import AliveRecord, progress_key, vouched_hash
from collab.swarm.timing import Timing
from collab.swarm.transport import (
    TAKEN,
    Header,
    Payloads,
    Received,
    SwarmNode,
    TransportError,
    pieces_of,
)

STATE = "collab.state"
MAX_ASKED_ROUNDS = 16  # group ids a requester may ask about (its failed attempts at one step)
MAX_CHUNKS = 1024  # chunk digests one manifest lists (about 34 KB of header): bigger states get bigger chunks
KEPT_SNAPSHOTS = 2  # serialized states a server keeps for downloads in progress
CHUNKS_IN_FLIGHT = 4  # chunk calls a download keeps open at once (checking one while the next arrive)
# one thread (shared, FIFO: every state's pieces are hashed in order) hashes downloaded chunks into the
# state's hash while the caller checks the next chunk's digest (sha256 and BLAKE3 release the GIL)
HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="collab-state-hash")
# a server digests a new snapshot's chunks on every core: its first answer waits for all of them
DIGESTERS = concurrent.futures.ThreadPoolExecutor(
    max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="collab-chunk-digest"
)


class StateRejected(RuntimeError):
    """A state download failed or its answer did not check out (one line)."""


class ForgedState(StateRejected):
    """Other members vouch for another state at the step the source served: the source lied."""


@dataclass(frozen=True)
class StateSource:
    """What a downloaded state must belong to."""

    config_version: str
    method: str
    timing: Timing


@dataclass(frozen=True)
class Downloaded:
    """A checked state and, of the groups the requester asked about, those whose committed round (in the
    source's lineage) holds the requester's contribution."""

    state: MethodState
    used: frozenset[str] = frozenset()


def asked_rounds(header: Mapping[str, object]) -> list[str]:
    """The group ids a state request asks about (bounded; anything malformed is ignored)."""
    rounds = header.get("rounds")
    if not isinstance(rounds, list):
        return []
    return [r for r in rounds[:MAX_ASKED_ROUNDS] if isinstance(r, str) and len(r) <= 64]


def chunk_digest(data: Payloads) -> str:
    """A chunk's digest in a manifest: BLAKE3 (about 2.5x sha256's speed here, and it releases the GIL
    too), 128 bits in hex, of its bytes or of its pieces in order. The state as a whole is still named by
    its sha256 (``MethodState.hash``)."""
    h = blake3.blake3()
    for piece in pieces_of(data):
        h.update(piece)
    return h.hexdigest(length=16)


def _cut(pieces: Sequence[memoryview], lo: int, hi: int) -> list[memoryview]:
    """Bytes ``lo:hi`` of the concatenation of ``pieces``, as views into them."""
    out, start = [], 0
    for piece in pieces:
        end = start + piece.nbytes
        if end > lo and start < hi:
            out.append(piece[max(lo - start, 0) : min(hi, end) - start])
        start = end
    return out


@dataclass
class Snapshot:
    """One state as a server hands it out in chunks: its serialization as pieces in place (the header,
    then each tensor's bytes: never a copy of the state) and a digest per chunk. ``unchanged()``: the
    state's tensors still hold those bytes (no in-place write since)."""

    step: int
    hash: str
    pieces: list[memoryview]
    chunk_bytes: int
    digests: list[str]
    unchanged: Callable[[], bool] = lambda: True

    @property
    def size(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def chunk(self, i: int) -> list[memoryview]:
        """Chunk ``i``'s bytes, in place."""
        return _cut(self.pieces, i * self.chunk_bytes, (i + 1) * self.chunk_bytes)

    def manifest(self) -> dict[str, object]:
        """The manifest's fields (the server adds run and method); the first chunk goes with it."""
        return {
            "step": self.step,
            "hash": self.hash,
            "size": self.size,
            "chunk_bytes": self.chunk_bytes,
            "chunks": self.digests,
        }


class Snapshots:
    """The states a server hands out (the latest :data:`KEPT_SNAPSHOTS`, by hash): a download reads every
    chunk from the same state while the server trains on (a step makes new tensors; a state changed in
    place since is gone, and the requester starts over from a manifest). Digested once per state."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._kept: dict[str, Snapshot] = {}

    def of(self, state: MethodState) -> Snapshot:
        digest = state.hash()
        snap = self._kept.pop(digest, None)
        if snap is None or not snap.unchanged():
            pieces = state.to_pieces()
            total = sum(p.nbytes for p in pieces)
            size = max(self.chunk_bytes, math.ceil(total / MAX_CHUNKS))
            # hashed in place, on every core
            chunks = [_cut(pieces, lo, lo + size) for lo in range(0, total, size)]
            digests = list(DIGESTERS.map(chunk_digest, chunks))
            fingerprint = state.fingerprint()
            snap = Snapshot(
                state.step, digest, pieces, size, digests, lambda: state.fingerprint() == fingerprint
            )
        self._kept[digest] = snap  # newest last
        while len(self._kept) > KEPT_SNAPSHOTS:
            self._kept.pop(next(iter(self._kept)))
        return snap

    def chunk(self, header: Mapping[str, object]) -> tuple[dict[str, object], list[memoryview]]:
        """The answer to a chunk call (``hash``, ``chunk``): the chunk's bytes, or an error when this
        server no longer holds that state (the requester starts over from a manifest)."""
        digest, i = header.get("hash"), header.get("chunk")
        snap = self._kept.get(digest) if isinstance(digest, str) else None
        if snap is None or not snap.unchanged():
            raise LookupError("that state is gone here (the peer moved on)")
        if not isinstance(i, int) or not 0 <= i < len(snap.digests):
            raise ValueError(f"no chunk {i!r} in a state of {len(snap.digests)} chunks")
        return {"hash": snap.hash, "chunk": i}, snap.chunk(i)


class StateServer:
    """Answers ``collab.state`` calls on ``node``: a manifest of ``state()`` (with the first chunk), then
    chunks of it; never to a peer that ``banned(peer)``. ``used(rounds, peer)``: of the group ids a
    requester asks about, those the served state's lineage committed with its contribution."""

    def __init__(
        self,
        node: SwarmNode,
        *,
        state: Callable[[], MethodState | None],
        method: str,
        config_version: str,
        chunk_bytes: int,
        banned: Callable[[str], bool] = lambda peer: False,
        used: Callable[[list[str], str], list[str]] = lambda rounds, peer: [],
    ) -> None:
        self.state, self.method, self.config_version = state, method, config_version
        self.banned, self.used = banned, used
        self.snapshots = Snapshots(chunk_bytes)
        node.serve(STATE, self._handle)

    async def _handle(self, header: Header, payload: Received, remote: str) -> tuple[Header, Payloads]:
        if self.banned(remote):
            raise PermissionError("banned from this run")
        if "chunk" in header:
            return self.snapshots.chunk(header)
        state = self.state()
        if state is None:
            raise RuntimeError("no state yet")
        snap = self.snapshots.of(state)
        answer = {
            **snap.manifest(),
            "method": self.method,
            "version": self.config_version,
            "used": self.used(asked_rounds(header), remote),
        }
        # a requester resuming this very state holds the first chunk already
        return answer, b"" if header.get("resume") == snap.hash else snap.chunk(0)


@dataclass
class Partial:
    """A download in progress: the first chunks of one state, checked, kept across sources and tries."""

    hash: str = ""
    size: int = 0
    chunk_bytes: int = 0
    digests: tuple[str, ...] = ()
    held: int = 0  # bytes held (the first chunks, checked)
    # the state's ``size`` bytes, allocated at the first chunk without zeroing: chunks are copied in once
    _buffer: memoryview | None = field(default=None, repr=False)
    streamed: StreamHash = field(default_factory=StreamHash)  # the state's hash, as the chunks came
    _hashing: concurrent.futures.Future[None] | None = None  # the latest chunk handed to HASHER

    @property
    def received(self) -> int:
        """Chunks held (every chunk but the last is whole)."""
        return math.ceil(self.held / self.chunk_bytes) if self.chunk_bytes else 0

    @property
    def data(self) -> memoryview:
        """The bytes held (writable: a complete state's tensors are read from them in place)."""
        return self._buffer[: self.held] if self._buffer is not None else memoryview(bytearray())

    def start(self, digest: str, size: int, chunk_bytes: int, digests: Sequence[str]) -> bool:
        """Resume when the manifest names the state held in part (``True``), else start over."""
        same = (digest, size, chunk_bytes, tuple(digests)) == (
            self.hash,
            self.size,
            self.chunk_bytes,
            self.digests,
        )
        if not same:
            self.hash, self.size, self.chunk_bytes, self.digests = digest, size, chunk_bytes, tuple(digests)
            self._drop_bytes()
        return same and self.held > 0

    def allocate(self) -> None:
        """Allocate the state's buffer (once per state; raises :class:`StateRejected` when it does not
        fit in this machine's memory)."""
        if self._buffer is None:
            try:
                self._buffer = torch.empty(self.size, dtype=torch.uint8).numpy().data
            except Exception:  # more than this machine can hold
                raise StateRejected(f"no memory for a state of {self.size} bytes") from None

    def place(self, i: int) -> memoryview:
        """Where chunk ``i`` goes in the state's buffer (after :meth:`allocate`): the transport may read
        the chunk straight into it; it counts as held only once :meth:`add` checked it."""
        assert self._buffer is not None
        lo = i * self.chunk_bytes
        return self._buffer[lo : lo + min(self.chunk_bytes, self.size - lo)]

    def add(
        self,
        i: int,
        blob: bytes | bytearray | memoryview,
        digest: str | None = None,
        *,
        in_place: bool = False,
    ) -> None:
        """Append chunk ``i`` (the next one), checked against its digest (``digest``: ``chunk_digest(blob)``,
        when the caller computed it already); ``in_place``: ``blob`` is :meth:`place` ``(i)``, the chunk
        was read there. Raises :class:`StateRejected`."""
        expected = min(self.chunk_bytes, self.size - i * self.chunk_bytes)
        if i * self.chunk_bytes != self.held:
            raise StateRejected(f"chunk {i + 1} of {len(self.digests)} is out of order")
        if len(blob) != expected or (digest or chunk_digest(blob)) != self.digests[i]:
            raise StateRejected(f"chunk {i + 1} of {len(self.digests)} does not match its digest")
        self.allocate()
        place = self.place(i)
        if not in_place:
            place[:] = blob
        self.held += len(blob)
        self._hashing = HASHER.submit(self.streamed.update, place)

    def hashed(self) -> StreamHash | None:
        """The state's hash over the chunks held, once the hashing thread has caught up (HASHER has one
        worker and runs in order: the latest chunk's job done means all are); ``None`` if it failed."""
        if self._hashing is not None:
            try:
                self._hashing.result()
            except Exception:  # no streamed digest: the parsed state is hashed as a whole instead
                return None
        return self.streamed

    def clear(self) -> None:
        self.hash, self.size, self.chunk_bytes, self.digests = "", 0, 0, ()
        self._drop_bytes()

    def _drop_bytes(self) -> None:
        self.held, self._buffer, self.streamed, self._hashing = 0, None, StreamHash(), None


def _manifest(header: Mapping[str, object], max_chunk: int) -> tuple[str, int, int, list[str]]:
    """Hash, size, chunk size and chunk digests of a manifest; raises :class:`StateRejected`."""
    digest, size, chunk_bytes, digests = (
        header.get("hash"),
        header.get("size"),
        header.get("chunk_bytes"),
        header.get("chunks"),
    )
    if not (
        isinstance(digest, str)
        and type(size) is int  # not a bool
        and type(chunk_bytes) is int
        and 0 < chunk_bytes <= max_chunk
        and isinstance(digests, list)
        and 0 < len(digests) <= MAX_CHUNKS
        and all(isinstance(d, str) for d in digests)
        and math.ceil(size / chunk_bytes) == len(digests)
    ):
        raise StateRejected("its state manifest is malformed")
    return digest, size, chunk_bytes, digests


def download_state(
    node: SwarmNode,
    peer: str,
    source: StateSource,
    *,
    rounds: Sequence[str] = (),
    partial: Partial | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Downloaded:
    """``peer``'s current state, checked against ``source``; raises :class:`StateRejected`.

    ``rounds``: group ids of rounds that failed here after this peer's contribution left; the answer
    says which of them the source's lineage committed with it (see ``Method.adopt_state``).
    ``partial``: a download that broke off; resumed when ``peer`` serves the same state, and kept up to
    date (so a caller that keeps it resumes the next try). ``progress(chunks_held, chunks)`` after each
    chunk."""
    partial = partial if partial is not None else Partial()
    timing = source.timing

    def call(header: dict[str, object]) -> tuple[dict[str, object], Received]:
        return node.run(
            node.call(peer, STATE, header, timeout_s=timing.state_call_s, link=False),
            timeout_s=timing.state_wait_s,
        )

    request: dict[str, object] = {"rounds": list(rounds[-MAX_ASKED_ROUNDS:])} if rounds else {}
    if partial.held:
        request["resume"] = partial.hash
    try:
        header, first = call(request)
    except (TransportError, TimeoutError) as e:
        raise StateRejected(f"download failed: {e}") from None
    if header.get("version") != source.config_version:
        raise StateRejected("it runs another config")
    if header.get("method") != source.method:
        raise StateRejected(f"it runs method {str(header.get('method'))[:40]!r}, not {source.method!r}")
    digest, size, chunk_bytes, digests = _manifest(header, node.max_message_bytes)
    if not partial.start(digest, size, chunk_bytes, digests) and first:
        partial.add(0, first)
    n = len(digests)
    # up to CHUNKS_IN_FLIGHT chunk calls at once: each chunk is checked (and hashed into the state's
    # hash) here while the next ones are on their way
    calls: dict[int, concurrent.futures.Future[tuple[Received | memoryview, str, bool]]] = {}

    partial.allocate()

    async def fetch(i: int) -> tuple[Received | memoryview, str, bool]:
        """Chunk ``i`` and its digest (computed on a DIGESTERS thread, as the chunk arrives). A chunk of
        the expected size is read straight into its place in the state's buffer."""
        place = partial.place(i)

        def sink(answer: Header, size: int) -> list[memoryview] | None:
            return [place] if size == place.nbytes else None

        # queued behind the calls ahead of it: each call gets their time too (a chunk still has to come
        # within state_wait_s of the one before it, as when chunks were fetched one at a time)
        call_s = CHUNKS_IN_FLIGHT * timing.state_call_s
        # state answers are large: over streams (over the link, one would come back "too large")
        chunk = {"hash": digest, "chunk": i}
        _, got = await node.call(peer, STATE, chunk, timeout_s=call_s, sink=sink, link=False)
        in_place = got is TAKEN
        blob = place if in_place else got
        return blob, await asyncio.get_running_loop().run_in_executor(DIGESTERS, chunk_digest, blob), in_place

    def ask(i: int) -> None:
        if i < n and i not in calls:
            calls[i] = node.submit(fetch(i))

    try:
        for i in range(partial.received, n):
            for ahead in range(i, i + CHUNKS_IN_FLIGHT):
                ask(ahead)
            if progress is not None:
                progress(i, n)
            pending_call = calls.pop(i)
            try:
                blob, blob_digest, in_place = pending_call.result(timing.state_wait_s)
            except Exception as e:  # unreachable, refused, too slow: this source failed, try another
                pending_call.cancel()
                raise StateRejected(f"download broke off at chunk {i + 1} of {n}: {e}") from None
            partial.add(i, blob, blob_digest, in_place=in_place)
    finally:
        for pending in calls.values():
            pending.cancel()
    if progress is not None:
        progress(n, n)
    try:
        state = MethodState.from_bytes(partial.data, streamed=partial.hashed())
    except ValueError as e:
        partial.clear()
        raise StateRejected(f"download failed: {e}") from None
    partial.clear()
    if digest != state.hash():
        raise StateRejected("its state does not match the hash it announced")
    used = header.get("used")
    asked = set(rounds)
    kept = frozenset(r for r in used if isinstance(r, str) and r in asked) if isinstance(used, list) else None
    return Downloaded(state, kept or frozenset())


def alive_steps(
    alive: Mapping[str, AliveRecord], *, exclude: str | None = None, sources: bool = False
) -> list[tuple[int, str]]:
    """``(step, peer)`` of the training peers in an alive view, most advanced first (``sources``: only
    those that can serve their state - not clients, which accept no incoming calls)."""
    steps = [
        (rec.step, peer)
        for peer, rec in alive.items()
        if peer != exclude and rec.trains and rec.step >= 0 and not (sources and rec.client)
    ]
    return sorted(steps, reverse=True)


class Vouches:
    """Checks that more than one member of the run vouches for a state (see the module docstring).

    ``me``: this peer's key (its own records never vouch for what it downloads; default: the node's);
    ``alone_ok``: the run allows groups of one, so a committed state may have no second voucher."""

    def __init__(
        self, node: SwarmNode, run_id: str, timing: Timing, *, me: str | None = None, alone_ok: bool = False
    ):
        self.node, self.key, self.timing, self._me = node, progress_key(run_id), timing, me
        self.alone_ok = alone_ok

    @property
    def me(self) -> str:
        return self._me if self._me is not None else self.node.peer_key

    def check(self, state: MethodState, source: str, alive: Mapping[str, AliveRecord]) -> None:
        """Return once two keys vouch for ``state`` (from ``source``); raise :class:`ForgedState` or
        :class:`StateRejected` when they do not within ``Timing.vouch_wait_s``. ``alive``: the run's alive
        view (with nobody but the source in it, the source's word is taken)."""
        if self.alone_ok or not [p for _, p in alive_steps(alive) if p not in (source, self.me)]:
            return
        step, digest = state.step, state.hash()
        deadline = time.monotonic() + self.timing.vouch_wait_s
        while True:
            support: set[str] = set()
            conflicting: set[str] = set()
            try:
                records = self.node.get_dict(self.key, timeout_s=self.timing.dht_s)
            except Exception:  # a slow DHT: look again until the deadline
                records = {}
            for voucher, record in records.items():  # one signed record per key
                said = _vouched(record, step, exclude=self.me)
                if said == digest:
                    support.add(voucher)
                elif said is not None:
                    conflicting.add(voucher)
            if len(support) >= 2:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(min(self.timing.vouch_poll_s, max(0.0, deadline - time.monotonic())))
        if conflicting:
            raise ForgedState(
                f"it served state {digest[:12]} at step {step}, which {len(support)} key(s) vouch for and "
                f"{len(conflicting)} vouch against"
            )
        raise StateRejected(f"{len(support)} key(s) vouch for its state {digest[:12]} at step {step}, not 2")


def _vouched(record: object, step: int, *, exclude: str) -> str | None:
    """The state hash ``record`` vouches for at ``step`` (``None``: none, or ``exclude``'s record)."""
    if not isinstance(record, dict) or record.get("peer") == exclude:
        return None
    return vouched_hash(record.get("states"), step)
