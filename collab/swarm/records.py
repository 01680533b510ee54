"""Signed per-peer progress records in the DHT: the wire contract between volunteers and the monitor.

Key ``{run_id}_progress``; subkey: the peer's RSA public key (``RSASignatureValidator``), so a peer can only
write its own record; value: a strict :class:`ProgressRecord` (``SchemaValidator`` with a pydantic v1 model,
unknown fields rejected). These models are separate from the pydantic v2 config models on purpose.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeGuard

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.timed_storage import get_dht_time
from pydantic.v1 import BaseModel, StrictBool, StrictFloat, StrictInt, StrictStr, conint, constr

RECORD_VERSION = 1
VOUCHED_STATES = 64  # a progress record vouches for this peer's latest committed (step, state hash) pairs
MAX_PUBLISHED_BANS = 64  # banned peers an alive record names


class PeerStatus(StrEnum):
    """The ``status`` of a peer's alive record (stored as its string value)."""

    STARTING = "starting"
    SYNCING = "syncing"  # learning who is alive, downloading the state
    TRAINING = "training"
    DONE = "done"  # reached its last step; still serving the state while it lingers
    LEFT = "left"
    COORDINATOR = "coordinator"  # the run's coordinator: names the run's config version, never trains


@dataclass(frozen=True)
class AliveRecord:
    """A peer's alive record (key ``{run_id}_alive``, subkey: its peer key), stored again every heartbeat.

    ``step``: its latest committed step (-1: none yet; the coordinator's is -1 too); ``version``: its
    config version (the coordinator's names the run's config; without a coordinator the majority of the
    alive peers does); ``rate``: its samples per second of computation, once settled (fellow members size
    target-batch rounds by it and bound its claims); ``microbatch``: the samples of one of its evaluations;
    ``client``: it accepts no incoming connections (behind NAT): never a leader, a part owner, a
    collector or a state source; ``bans``: the peers it bans now (at most :data:`MAX_PUBLISHED_BANS`):
    peers choose leaders that nobody bans (see :mod:`collab.swarm.matchmaking`), never ban on them.
    """

    step: int
    status: PeerStatus
    name: str = ""
    version: str = ""
    device: int = -1
    rate: float | None = None
    microbatch: float | None = None
    client: bool = False
    bans: tuple[str, ...] = ()

    @property
    def trains(self) -> bool:
        """A volunteer that has not left (not the coordinator)."""
        return self.status not in (PeerStatus.COORDINATOR, PeerStatus.LEFT)

    def to_wire(self) -> dict[str, object]:
        return {
            "step": self.step,
            "status": self.status.value,
            "name": self.name,
            "version": self.version,
            "device": self.device,
            "rate": self.rate,
            "microbatch": self.microbatch,
            "client": self.client,
            "bans": list(self.bans[:MAX_PUBLISHED_BANS]),
        }

    @classmethod
    def parse(cls, value: object) -> AliveRecord | None:
        """The record ``value`` (as read from the DHT) says, or ``None`` when it is malformed: a field of the
        wrong type, an unknown status. A ``rate`` or ``microbatch`` that is not a positive finite number
        reads as unpublished."""
        if not isinstance(value, dict):
            return None
        step, status, name, version, device = (
            value.get("step"),
            value.get("status"),
            value.get("name", ""),
            value.get("version", ""),
            value.get("device", -1),
        )
        if not (_strict_int(step) and _strict_int(device)) or not isinstance(name, str):
            return None
        if not isinstance(version, str) or not isinstance(status, str):
            return None
        client = value.get("client", False)
        if not isinstance(client, bool):
            return None
        bans = value.get("bans", [])
        if not isinstance(bans, list) or not all(isinstance(b, str) for b in bans):
            return None
        try:
            parsed_status = PeerStatus(status)
        except ValueError:
            return None
        return cls(
            step=step,
            status=parsed_status,
            name=name,
            version=version,
            device=device,
            rate=_positive(value.get("rate")),
            microbatch=_positive(value.get("microbatch")),
            client=client,
            bans=tuple(bans[:MAX_PUBLISHED_BANS]),
        )


def _strict_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def parse_alive(raw: object) -> dict[str, AliveRecord]:
    """The well-formed records of peers that have not left, from a ``{subkey: value}`` read of the alive key
    (malformed records are left out: a peer that writes garbage is not counted alive)."""
    if not isinstance(raw, dict):
        return {}
    view = {}
    for peer, value in raw.items():
        record = AliveRecord.parse(value)
        if isinstance(peer, str) and record is not None and record.status != PeerStatus.LEFT:
            view[peer] = record
    return view


def alive_key(run_id: str) -> str:
    return f"{run_id}_alive"


MAX_VOUCH_CHARS = 20 + 1 + 64 + 1  # one vouch: "step:hash " (a step of up to 20 digits, a hash of 64)


def vouches_text(states: Iterable[tuple[int, str]]) -> str:
    """The ``states`` field of a progress record: ``"step:hash step:hash ..."``, oldest first. One string,
    not a list of models: every DHT node validates every record it stores or returns, and a list of
    64 pydantic models made that the DHT processes' largest cost."""
    return " ".join(f"{step}:{digest}" for step, digest in states)


def vouched_hash(text: object, step: int) -> str | None:
    """The hash that a record's ``states`` text names for ``step`` (``None``: none, or malformed)."""
    if not isinstance(text, str):
        return None
    for item in text.split(" "):
        said_step, sep, digest = item.partition(":")
        if sep and said_step == str(step) and 0 < len(digest) <= 64:
            return digest
    return None


class ProgressRecord(BaseModel):
    """One peer's latest progress (version 1). ``peer`` is the writer's libp2p peer id (as it says) and
    ``states`` the latest states it committed, newest last (:func:`vouches_text`)."""

    record_version: conint(strict=True, ge=1) = RECORD_VERSION  # type: ignore[valid-type]
    step: conint(strict=True, ge=0)  # type: ignore[valid-type]
    samples: conint(strict=True, ge=0)  # type: ignore[valid-type]
    samples_per_s: StrictFloat
    metric: StrictFloat
    metric_name: StrictStr
    bits_up: StrictFloat
    bits_down: StrictFloat
    wire_sent: StrictInt
    wire_received: StrictInt
    group_size: StrictInt
    round_share: StrictFloat  # this peer's samples / the group's, in its latest round (0..1)
    device: StrictStr
    client_mode: StrictBool
    software_version: StrictStr
    config_version: StrictStr
    name: StrictStr
    time: StrictFloat
    peer: StrictStr = ""
    states: constr(strict=True, max_length=VOUCHED_STATES * MAX_VOUCH_CHARS) = ""  # type: ignore[valid-type]

    class Config:
        extra = "forbid"


class BanEntry(BaseModel):
    peer: StrictStr  # the banned peer's key
    reason: StrictStr
    round_id: StrictStr
    time: StrictFloat
    until: StrictFloat

    class Config:
        extra = "forbid"


class BanReport(BaseModel):
    """The bans one peer currently holds (key ``{run_id}_bans``, subkey: the reporter's public key)."""

    name: StrictStr
    bans: list[BanEntry]
    time: StrictFloat

    class Config:
        extra = "forbid"


class ProgressSchema(BaseModel):
    progress: dict[BytesWithPublicKey, ProgressRecord | None]
    bans: dict[BytesWithPublicKey, BanReport | None]


def dht_time() -> float:
    """The DHT's notion of now (seconds): what record timestamps and expirations are measured in."""
    return float(get_dht_time())


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def bans_key(run_id: str) -> str:
    return f"{run_id}_bans"


def make_validators(run_id: str) -> tuple[list[RecordValidatorBase], RSASignatureValidator]:
    """The DHT record validators of a run, and the signature validator (its public key is our subkey)."""
    signer = RSASignatureValidator()
    return [signer, SchemaValidator(ProgressSchema, prefix=run_id, allow_extra_keys=True)], signer
