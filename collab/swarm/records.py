"""Signed per-peer progress records in the DHT: the wire contract between volunteers and the monitor.

Key ``{run_id}_progress``; subkey: the peer's RSA public key (``RSASignatureValidator``), so a peer can only
write its own record; value: a strict :class:`ProgressRecord` (``SchemaValidator`` with a pydantic v1 model,
unknown fields rejected). These models are separate from the pydantic v2 config models on purpose.
"""

from __future__ import annotations

from enum import StrEnum

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.timed_storage import get_dht_time
from pydantic.v1 import BaseModel, StrictBool, StrictFloat, StrictInt, StrictStr, conint, conlist, constr

RECORD_VERSION = 1
VOUCHED_STATES = 16  # a progress record vouches for this peer's latest committed (step, state hash) pairs


class PeerStatus(StrEnum):
    """The ``status`` of a peer's alive record (stored as its string value)."""

    STARTING = "starting"
    SYNCING = "syncing"  # learning who is alive, downloading the state
    TRAINING = "training"
    DONE = "done"  # reached its last step; still serving the state while it lingers
    LEFT = "left"
    COORDINATOR = "coordinator"  # the run's coordinator: names the run's config version, never trains


class StateVouch(BaseModel):
    """A state this peer committed: a peer that downloads it checks that others vouch for its hash."""

    step: conint(strict=True, ge=0)  # type: ignore[valid-type]
    hash: constr(strict=True, max_length=64)  # type: ignore[valid-type]

    class Config:
        extra = "forbid"


class ProgressRecord(BaseModel):
    """One peer's latest progress (version 1). ``peer`` is the writer's libp2p peer id (as it says) and
    ``states`` the latest states it committed, newest last."""

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
    states: conlist(StateVouch, max_items=VOUCHED_STATES) = []  # type: ignore[valid-type]

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
