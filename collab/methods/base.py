"""The contract between a method and the aggregation under it, and the replicated method state.

Knows tensors, compressed messages and seeds; never networking. A method is a pure state machine: it
evaluates its local devices' operators, hands their compressed messages to an :class:`Aggregator`, and
applies the identical update on every group member. The aggregator (in-process simulation, or the swarm)
only has to return the same aggregate to everyone.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from collab.compression import CompressedMessage, Compressor, MessageKind
from collab.methods.optimizers import UpdateRule
from collab.tasks.base import LocalOperator


class RoundFailed(RuntimeError):
    """A round could not complete for the whole group (peer lost, timeout). Nothing may be applied;
    the caller redoes the step."""


@dataclass(frozen=True)
class RoundKey:
    """Identifies one exchange: the step and the phase within it (``init``, ``delta``, ``refresh``...)."""

    step: int
    phase: str

    def __str__(self) -> str:
        return f"{self.step}:{self.phase}"


@dataclass(frozen=True)
class Contribution:
    """One local device's message and its weight (samples) in the average."""

    message: CompressedMessage
    weight: float = 1.0


ServerFn = Callable[[CompressedMessage], CompressedMessage]


@dataclass
class CommStats:
    """Per-device communication totals.

    ``bits_up``/``bits_down`` are the paper's algorithmic bits (device->server, server->device) for one
    device; ``wire_bytes_sent``/``wire_bytes_received`` are what crossed the network (0 in simulation).
    """

    bits_up: float = 0.0
    bits_down: float = 0.0
    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0
    rounds: int = 0

    @property
    def bits(self) -> float:
        return self.bits_up + self.bits_down


class Aggregator(ABC):
    """Exact group aggregation: every member gets the same bytes for the aggregate.

    ``reduce`` averages the contributions of all group members (weighted), applies ``server`` (the
    deterministic server-side compression step) to the average, counts bits, and returns the result.
    It raises :class:`RoundFailed` when the group cannot finish the round.
    """

    stats: CommStats
    # Id of the group the local devices' last contribution was handed to (set before it can fail, None
    # when nothing was sent, always None in simulation). A member whose round failed locally after its
    # contribution left can later learn that the group committed with it (Method.adopt_state's ``used``).
    last_attempt: str | None = None

    @property
    @abstractmethod
    def num_local(self) -> int:
        """How many devices this process contributes for (M in simulation, 1 on a peer)."""

    @abstractmethod
    def reduce(
        self, key: RoundKey, contributions: Sequence[Contribution], server: ServerFn
    ) -> CompressedMessage:
        """The server message computed from the group's weighted average."""

    @property
    def last_group_size(self) -> int:
        """Number of devices in the last completed round."""
        return self.num_local

    def prepare(self, key: RoundKey) -> None:  # noqa: B027 (an optional hook: most aggregators need none)
        """Called before the local devices compute for round ``key``: an aggregator may form the round's
        group now, so members start computing together (default: nothing). May raise RoundFailed."""


class MicrobatchPlan(Protocol):
    """How many microbatches a device evaluates at a round's points: ``more(done, elapsed_s)`` is asked
    before each one (``done`` finished so far, ``elapsed_s`` since the first began); the first is always
    evaluated."""

    def more(self, done: int, elapsed_s: float) -> bool: ...

    @property
    def deadline_s(self) -> float | None:
        """Seconds after which a device that has not finished its first microbatch tags along with
        weight 0 (None: it always finishes one)."""
        ...


@dataclass(frozen=True)
class FixedMicrobatches:
    """Exactly ``count`` microbatches (the default, 1: what ``collab simulate`` computes)."""

    count: int = 1
    deadline_s: float | None = None

    def more(self, done: int, elapsed_s: float) -> bool:
        return done < self.count


@dataclass(frozen=True)
class TimeBudget:
    """As many microbatches as fit in ``seconds`` of this device's time, judged by the mean time of the
    ones done so far (at least one: a device slower than the budget contributes one, late - or, past
    ``deadline_s``, none: it tags along with weight 0)."""

    seconds: float
    deadline_s: float | None = None  # tag along past this (None: a slow device contributes one, late)

    def more(self, done: int, elapsed_s: float) -> bool:
        return done == 0 or elapsed_s * (done + 1) / done <= self.seconds


class _Evaluation:
    """Runs a device's first microbatch of a round with a time limit.

    The evaluation runs on a helper thread; past the limit the caller goes on without it and the thread
    is left to finish (an operator cannot be interrupted mid-way). A device evaluates one thing at a time
    (operators hold buffers and gradients), so the next evaluation first waits for a dropped one, within
    its own time limit."""

    def __init__(self) -> None:
        self._dropped: threading.Thread | None = None

    def run(self, fn: Callable[[], list[torch.Tensor]], *, timeout_s: float) -> list[torch.Tensor] | None:
        start = time.monotonic()
        if self._dropped is not None:
            self._dropped.join(max(0.0, timeout_s))
            if self._dropped.is_alive():
                return None
            self._dropped = None
        box: dict[str, object] = {}

        def target() -> None:
            try:
                box["out"] = fn()
            except BaseException as e:  # handed to the caller below when it waited for the result
                box["error"] = e

        thread = threading.Thread(target=target, name="collab-evaluate", daemon=True)
        thread.start()
        thread.join(max(0.0, timeout_s - (time.monotonic() - start)))
        if thread.is_alive():
            self._dropped = thread
            return None
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["out"]  # type: ignore[return-value]


@dataclass
class Worker:
    """One local device: its operator, its compressor and its error-feedback buffer (MASHA2).

    ``compress_seed`` is the seed its compressor draws from: the run seed when every device must pick the
    same Rand-k coordinates (the default), or a per-device seed for independent coordinates.
    """

    operator: LocalOperator
    compressor: Compressor
    error: torch.Tensor | None = None
    compress_seed: int | None = None


@dataclass
class MethodState:
    """The replicated state: identical on every group member after every step."""

    step: int
    z: torch.Tensor
    w: torch.Tensor
    fw: torch.Tensor
    server_error: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # (fingerprint, hash) of the last hash computed: a state is hashed once, however often it is asked
    _hash_cache: tuple[object, str] | None = field(default=None, init=False, repr=False, compare=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"z": self.z, "w": self.w, "fw": self.fw}
        if self.server_error is not None:
            out["server_error"] = self.server_error
        out.update(self.extra)
        return out

    def hash(self) -> str:
        """sha256 over the step and the exact bytes of every tensor (hex, first 16 bytes).

        Computed once per state: the result is kept until the step, a tensor (another object, or one
        changed in place: torch counts in-place writes in ``_version``) or the set of tensors changes."""
        fingerprint = self.fingerprint()
        if self._hash_cache is not None and self._hash_cache[0] == fingerprint:
            return self._hash_cache[1]
        digest = self._digest()
        self._hash_cache = (fingerprint, digest)
        return digest

    def _digest(self) -> str:
        h = hashlib.sha256(f"step={self.step}".encode())
        for name, t in sorted(self.tensors().items()):
            h.update(name.encode())
            h.update(t.detach().contiguous().cpu().reshape(-1).numpy().data)  # in place, no copy
        return h.hexdigest()[:32]

    def known_hash(self, digest: str) -> None:
        """Take ``digest`` as this state's :meth:`hash` without hashing it again: only for a digest
        computed over these very bytes (:class:`StreamHash` of the serialization they were read from)."""
        self._hash_cache = (self.fingerprint(), digest)

    def fingerprint(self) -> object:
        """What identifies these exact bytes cheaply: the step and each tensor's object, memory and
        in-place write counter (torch's ``_version``). Equal fingerprints: the same bytes."""
        tensors = sorted(self.tensors().items())
        return (self.step, tuple((n, id(t), t.data_ptr(), t._version, t.shape, t.dtype) for n, t in tensors))

    def to_bytes(self) -> bytearray:
        """Serialize: a JSON header (step, tensor names, sizes, hash) and the raw float32 bytes, written
        straight into one buffer (the state's size once, no intermediate copies)."""
        head, tensors = self._serial_head()
        out = bytearray(len(head) + sum(4 * t.numel() for _, t in tensors))
        self._serial_fill(torch.frombuffer(out, dtype=torch.uint8), head, tensors)
        return out

    def to_pieces(self) -> list[memoryview]:
        """The bytes of :meth:`to_bytes` as pieces in order, without copying the state: the header, then
        each tensor's float32 bytes in place (a tensor that is not fp32, contiguous and on the CPU is
        converted first). The pieces hold the tensors and read whatever they hold: they are this state's
        serialization only while :meth:`fingerprint` is unchanged."""
        head, tensors = self._serial_head()
        pieces = [memoryview(head)]
        for _, t in tensors:
            if t.numel():
                flat = t.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
                pieces.append(flat.numpy().data.cast("B"))
        return pieces

    def _serial_head(self) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
        tensors = sorted(self.tensors().items())
        header = {
            "version": 1,
            "step": self.step,
            "tensors": [[name, int(t.numel())] for name, t in tensors],
            "hash": self.hash(),
        }
        head = json.dumps(header).encode()
        head += b" " * (-(4 + len(head)) % 64)  # the tensors start aligned: a reader can use them in place
        return len(head).to_bytes(4, "little") + head, tensors

    @staticmethod
    def _serial_fill(out: torch.Tensor, head: bytes, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Write the serialization (``head``, then the tensors' bytes) into ``out`` (uint8, its size)."""
        out[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        offset = len(head)
        for _, t in tensors:
            if t.numel():
                out[offset : offset + 4 * t.numel()].view(torch.float32).copy_(t.detach().reshape(-1))
            offset += 4 * t.numel()

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, *, streamed: StreamHash | None = None
    ) -> MethodState:
        """Parse :meth:`to_bytes` output and check its hash; raises ``ValueError`` on any mismatch.

        The tensors share the memory of a ``bytearray`` or writable ``memoryview`` (no copy; the caller
        must not reuse it); ``bytes`` are copied once. ``streamed``: a :class:`StreamHash` that was fed
        exactly ``data`` as it arrived; its digest, when it has one, is the state's hash (no second pass
        over the bytes)."""
        writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
        buf = data if writable else bytearray(data)
        try:
            n = int.from_bytes(buf[:4], "little")
            header = json.loads(bytes(buf[4 : 4 + n]))
            offset = 4 + n
            tensors: dict[str, torch.Tensor] = {}
            for name, numel in header["tensors"]:
                str(name).encode()  # hashed as UTF-8: a name that is not (a lone surrogate) is malformed
                count = int(numel)
                if count < 0 or offset + 4 * count > len(buf):
                    raise ValueError("truncated state")
                if count == 0:
                    tensors[str(name)] = torch.zeros(0)
                elif offset % 4:  # written unaligned (before the header was padded): copy
                    tensors[str(name)] = torch.frombuffer(
                        bytearray(buf[offset : offset + 4 * count]), dtype=torch.float32
                    )
                else:
                    tensors[str(name)] = torch.frombuffer(
                        buf, dtype=torch.float32, count=count, offset=offset
                    )
                offset += 4 * count
            if offset != len(buf):
                raise ValueError("trailing bytes after state")
            state = cls(
                step=int(header["step"]),
                z=tensors.pop("z"),
                w=tensors.pop("w"),
                fw=tensors.pop("fw"),
                server_error=tensors.pop("server_error", None),
                extra=tensors,
            )
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed method state: {e}") from None
        digest = streamed.digest(len(buf)) if streamed is not None else None
        if digest is not None:
            state.known_hash(digest)
        if state.hash() != header.get("hash"):
            raise ValueError("method state hash mismatch: refusing to load it")
        return state

    def clone(self) -> MethodState:
        return MethodState(
            step=self.step,
            z=self.z.clone(),
            w=self.w.clone(),
            fw=self.fw.clone(),
            server_error=None if self.server_error is None else self.server_error.clone(),
            extra={k: v.clone() for k, v in self.extra.items()},
        )


MAX_STREAMED_HEADER_BYTES = 1 << 20  # a serialization header beyond this gets no streamed digest


class StreamHash:
    """:meth:`MethodState.hash` of a :meth:`MethodState.to_bytes` serialization that arrives in pieces,
    computed as they arrive (a download hashes while the next pieces are on their way, and never passes
    over the whole state again). Feed every piece, in order, to :meth:`update`.

    Only a serialization laid out as :meth:`to_bytes` writes it (tensor names unique and sorted) gets a
    digest; for anything else :meth:`digest` is ``None`` and the caller hashes the parsed state itself."""

    def __init__(self) -> None:
        self._pos = 0  # bytes fed so far
        self._prefix: bytearray | None = bytearray()  # bytes held until the header is complete
        self._sha: hashlib._Hash | None = None
        self._segments: list[tuple[int, int, bytes]] = []  # (start, end, name) of each tensor's bytes
        self._next = 0  # the segment the next bytes belong to
        self._named = False  # that segment's name is in the hash already
        self._size = -1  # the serialization's length, once the header is read (-1: not a valid layout)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        start = self._pos
        self._pos += len(view)
        if self._prefix is not None:
            self._prefix += view
            if not self._parse():
                return
            view, start, self._prefix = memoryview(bytes(self._prefix)), 0, None
        if self._sha is not None:
            self._feed(view, start)

    def digest(self, size: int) -> str | None:
        """The state's hash once all ``size`` bytes were fed; ``None`` when it cannot be known here."""
        if self._sha is None or self._pos != size or self._size != size:
            return None
        for lo, hi, name in self._segments[self._next :]:  # empty tensors at the very end
            if hi != lo:
                return None
            if not self._named:
                self._sha.update(name)
            self._named = False
        self._next = len(self._segments)
        return self._sha.hexdigest()[:32]

    def _parse(self) -> bool:
        """Read the header from the prefix once it is complete (``True``); give up on a strange one (no
        digest then: whoever parses the state hashes it itself)."""
        assert self._prefix is not None
        buf = self._prefix
        if len(buf) < 4:
            return False
        n = int.from_bytes(buf[:4], "little")
        if n > MAX_STREAMED_HEADER_BYTES:
            self._prefix = None
            return False
        if len(buf) < 4 + n:
            return False
        self._prefix = None  # read once, whatever it holds
        try:
            header = json.loads(bytes(buf[4 : 4 + n]))
            step = int(header["step"])
            entries = [(name, int(numel)) for name, numel in header["tensors"]]
            names = [name for name, _ in entries]
            if not entries or not all(isinstance(x, str) for x in names) or names != sorted(set(names)):
                return False  # not the layout to_bytes writes
            segments: list[tuple[int, int, bytes]] = []
            offset = 4 + n
            for name, count in entries:
                if count < 0:
                    return False
                segments.append((offset, offset + 4 * count, name.encode()))
                offset += 4 * count
        except Exception:  # whatever a hostile header provokes (bad JSON, huge numbers, lone surrogates)
            return False
        self._prefix = buf  # the caller feeds the whole prefix from its start
        self._segments, self._size = segments, offset
        self._sha = hashlib.sha256(f"step={step}".encode())
        return True

    def _feed(self, view: memoryview, start: int) -> None:
        assert self._sha is not None
        end = start + len(view)
        while self._next < len(self._segments):
            lo, hi, name = self._segments[self._next]
            if lo >= end:
                return
            if not self._named:
                self._sha.update(name)
                self._named = True
            a, b = max(lo, start), min(hi, end)
            if b > a:
                self._sha.update(view[a - start : b - start])
            if hi > end:
                return
            self._next, self._named = self._next + 1, False


@dataclass(frozen=True)
class StepReport:
    """What one step did (for progress bars, records and metrics)."""

    step: int
    bits_up: float
    bits_down: float
    group_size: int
    refreshed: bool = False


class Method(ABC):
    """Base of the methods: holds the replicated state, the local workers and the aggregator.

    Subclasses implement :meth:`_initial_state` and :meth:`_step`; both must only *compute* and return a
    new state (and new device buffers) and leave ``self`` untouched, so a :class:`RoundFailed` in any
    round of a step leaves the method exactly as it was and the step can be redone.
    """

    name: str = "method"
    error_feedback: bool = False  # whether devices keep error-feedback buffers (MASHA2)
    local_start: bool = False  # the initial state needs no round: every peer computes the same one

    def __init__(
        self,
        *,
        z0: torch.Tensor,
        workers: Sequence[Worker],
        aggregator: Aggregator,
        gamma: float,
        seed: int,
        project: Callable[[torch.Tensor], torch.Tensor] | None = None,
        optimizer: UpdateRule | None = None,
    ) -> None:
        if gamma <= 0:
            raise ValueError("gamma must be positive")
        if len(workers) != aggregator.num_local:
            raise ValueError("one worker per local device of the aggregator")
        self.workers = list(workers)
        self.aggregator = aggregator
        self.gamma = float(gamma)
        # The update rule on the group's direction (default: the paper's constant-stepsize step); its
        # moments live in MethodState.extra, so they are hashed, checkpointed and synced with the state.
        self.optimizer = optimizer or UpdateRule(name="sgd", gamma=gamma)
        self.seed = int(seed)
        self.project = project or (lambda z: z)
        self.dim = int(z0.numel())
        self._z0 = z0.detach().float().reshape(-1).clone()
        self.state: MethodState | None = None
        # local, never replicated: how much each device computes per round, and what it last contributed
        self.microbatches: MicrobatchPlan = FixedMicrobatches(1)
        self._evaluation = _Evaluation()
        self.last_samples = 0.0  # samples behind the local devices' messages of the last step
        self._step_samples = 0.0
        self.last_compute_s = 0.0  # seconds the local devices spent on those samples
        self._step_compute_s = 0.0
        # device buffers (MASHA2's error feedback) computed for contributions that were sent in rounds
        # that then failed here, by group id: if the group committed with them, they are the buffers
        self._pending: dict[str, list[torch.Tensor | None]] = {}

    PENDING_LIMIT = 8  # attempts at one step whose buffers are kept

    def _sent(self, errors: list[torch.Tensor | None]) -> None:
        """Remember the device buffers that go with the contribution just handed to the aggregator."""
        token = self.aggregator.last_attempt
        if token is None or not self.error_feedback:
            return
        self._pending[token] = errors
        while len(self._pending) > self.PENDING_LIMIT:
            self._pending.pop(next(iter(self._pending)))

    @property
    def pending_rounds(self) -> list[str]:
        """Groups this peer's contributions went to in rounds that failed here (newest last)."""
        return list(self._pending)

    def _evaluate(
        self,
        worker: Worker,
        points: Sequence[torch.Tensor],
        *,
        step: int,
        full: bool = False,
        count: int | None = None,
    ) -> tuple[list[torch.Tensor], float, int]:
        """``worker``'s operator at ``points``, averaged over the microbatches its plan allows (or exactly
        ``count``, to repeat an earlier evaluation's sample set): the means, their weight (samples) and
        the count. One microbatch gives the operator's own tensors, bit for bit; so does an exact operator
        (``LocalOperator.exact``: no sampling) however many it evaluates, and it weighs one evaluation -
        repeats are no data, and weighting a device's shard by how often its machine repeated it would
        tilt a heterogeneous problem toward fast machines' shards (and MASHA's estimator with it).

        With a plan that has a deadline, a device that cannot finish even one microbatch in time takes
        part with weight 0 (zeros, count 0): it tags along, applies the group's aggregate and stays in
        sync; the evaluation it began is dropped when it ends (:class:`_Evaluation`)."""
        start = time.monotonic()
        sums: list[torch.Tensor] = []
        exact = worker.operator.exact  # further microbatches repeat the first: keep it, count it once
        done = 0
        deadline = self.microbatches.deadline_s if count is None else None
        while (done < count) if count is not None else self.microbatches.more(done, time.monotonic() - start):
            if done == 0 and deadline is not None:
                first = self._evaluation.run(
                    lambda: worker.operator.evaluate(points, step=step, full=full, microbatch=0),
                    timeout_s=deadline - (time.monotonic() - start),
                )
                if first is None:  # too slow for this round: tag along
                    return [torch.zeros_like(p) for p in points], 0.0, 0
                out = first
            else:
                out = worker.operator.evaluate(points, step=step, full=full, microbatch=done)
            if done == 0:
                sums = out
            elif not exact:
                sums = [a + b for a, b in zip(sums, out, strict=True)]
            done += 1
        if done == 0:  # repeating a tag-along's (empty) sample set
            return [torch.zeros_like(p) for p in points], 0.0, 0
        if exact or done == 1:
            means, samples = sums, worker.operator.weight
        else:
            means, samples = [t / done for t in sums], worker.operator.weight * done
        if not full:
            self._step_samples += samples
            self._step_compute_s += time.monotonic() - start
        return means, samples, done

    @property
    def initialized(self) -> bool:
        return self.state is not None

    def initialize(self) -> None:
        """Run the initial exchange (e.g. the full operator at ``w^0``)."""
        self.state = self._initial_state()

    def step(self) -> StepReport:
        """One step; on :class:`RoundFailed` nothing changes (redo with a new group)."""
        if self.state is None:
            self.initialize()
        assert self.state is not None
        before_up, before_down = self.aggregator.stats.bits_up, self.aggregator.stats.bits_down
        self._step_samples = self._step_compute_s = 0.0
        new_state, new_errors, refreshed = self._step(self.state)
        self.state = new_state
        self._pending.clear()
        self.last_samples = self._step_samples
        self.last_compute_s = self._step_compute_s
        for worker, err in zip(self.workers, new_errors, strict=True):
            worker.error = err
        return StepReport(
            step=new_state.step,
            bits_up=self.aggregator.stats.bits_up - before_up,
            bits_down=self.aggregator.stats.bits_down - before_down,
            group_size=self.aggregator.last_group_size,
            refreshed=refreshed,
        )

    def adopt_state(self, state: MethodState, *, used: Collection[str] = ()) -> None:
        """Take over a replicated state downloaded from a peer (or a checkpoint).

        Local device buffers (MASHA2's error feedback) are this device's unsent residual, not part of the
        replicated state: they are kept (zero on a fresh device). If ``used`` names a group whose round
        failed here after this device's contribution left, and that group committed with it (the state's
        source says so), the buffers computed for that contribution are taken: the device then holds
        exactly what it would hold had the round not failed here.
        """
        if state.z.numel() != self.dim:
            raise ValueError(f"state has {state.z.numel()} coordinates, this method {self.dim}")
        expected = set(self.optimizer.init_moments(0))
        if set(state.extra) != expected:
            raise ValueError(
                f"state holds optimizer tensors {sorted(state.extra)}, this method's {self.optimizer.name} "
                f"needs {sorted(expected)}"
            )
        if any(t.numel() != self.dim for t in state.extra.values()):
            raise ValueError("state's optimizer tensors do not match the parameter count")
        self.state = state.clone()
        committed = next((self._pending[t] for t in used if t in self._pending), None)
        self._pending.clear()
        for i, worker in enumerate(self.workers):
            if not self.error_feedback:
                worker.error = None
            elif committed is not None:
                worker.error = committed[i]
            elif worker.error is None or worker.error.numel() != self.dim:
                worker.error = torch.zeros(self.dim)

    @property
    def z(self) -> torch.Tensor:
        assert self.state is not None
        return self.state.z

    @abstractmethod
    def _initial_state(self) -> MethodState: ...

    @abstractmethod
    def _step(self, state: MethodState) -> tuple[MethodState, list[torch.Tensor | None], bool]: ...

    # helpers shared by the methods -------------------------------------------------------------
    def _dense_average(
        self, key: RoundKey, vectors: Sequence[torch.Tensor], weights: Sequence[float]
    ) -> torch.Tensor:
        """Exact uncompressed average of one vector per local device.

        Nothing is copied at full size: each vector goes out as it is (``vectors`` are this round's fresh
        operator values, read only), and the aggregate, a vector the reducer allocated for this round, is
        returned as it is: two full-size copies fewer per member and refresh (800 MB at 100M values)."""
        contributions = [
            Contribution(CompressedMessage(MessageKind.DENSE, v.numel(), v.detach().reshape(-1)), w)
            for v, w in zip(vectors, weights, strict=True)
        ]
        mean = self.aggregator.reduce(key, contributions, server=lambda s: s)
        if mean.kind != MessageKind.DENSE or any(mean.values.data_ptr() == v.data_ptr() for v in vectors):
            return mean.decompress()  # (never the case today; a copy keeps the inputs apart if it were)
        return mean.values
