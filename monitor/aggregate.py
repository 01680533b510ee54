"""Aggregate peers' progress records into the swarm's picture (pure: no networking, no storage).

Input: ``{peer_key: record_dict}`` as read from the DHT key ``{run_id}_progress`` (already schema- and
signature-checked by the DHT validators; :func:`validate_record` checks again and rejects what does not
belong to this run). Output: a :class:`Summary` for one moment and per-contributor totals.

The effective compression ratio compares the algorithmic bits a peer actually sent with what
uncompressed extragradient would have sent for the same number of steps (``dense_bits_per_step``: two
dense exchanges of 32-bit values, ``64 * d`` bits).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

REQUIRED = {
    "step": int,
    "samples": int,
    "samples_per_s": float,
    "metric": float,
    "metric_name": str,
    "bits_up": float,
    "bits_down": float,
    "wire_sent": int,
    "wire_received": int,
    "group_size": int,
    "round_share": float,
    "device": str,
    "client_mode": bool,
    "config_version": str,
    "name": str,
    "time": float,
}


class BadRecord(ValueError):
    """A record that is malformed or not from this run."""


def validate_record(record: Any, *, config_version: str | None = None) -> dict[str, Any]:
    """The record as a plain dict, or :class:`BadRecord` naming the first problem."""
    if not isinstance(record, Mapping):
        raise BadRecord("record is not a mapping")
    out: dict[str, Any] = {}
    for field, kind in REQUIRED.items():
        value = record.get(field)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise BadRecord(f"field {field!r} missing or not {kind.__name__}")
        out[field] = value
    if out["step"] < 0 or out["samples"] < 0:
        raise BadRecord("negative step or samples")
    if config_version is not None and out["config_version"] != config_version:
        raise BadRecord(f"record from another config ({out['config_version']})")
    return out


@dataclass(frozen=True)
class Summary:
    """The swarm at one moment."""

    time: float
    global_step: int
    alive_peers: int
    samples_per_s: float
    metric: float | None
    metric_name: str
    bits_up: float  # per peer, mean over alive peers
    bits_down: float
    wire_sent: float  # per peer, mean over alive peers
    wire_received: float
    compression_ratio: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    records: Mapping[str, Mapping[str, Any]],
    *,
    now: float,
    alive_window_s: float,
    dense_bits_per_step: float | None = None,
) -> Summary:
    """Aggregate valid records; peers not heard from within ``alive_window_s`` do not count as alive."""
    alive = [r for r in records.values() if now - float(r["time"]) <= alive_window_s]
    if not alive:
        return Summary(now, 0, 0, 0.0, None, "", 0.0, 0.0, 0.0, 0.0, None)
    step = max(int(r["step"]) for r in alive)
    at_step = [
        float(r["metric"]) for r in alive if int(r["step"]) == step and math.isfinite(float(r["metric"]))
    ]
    bits_up = statistics.fmean(float(r["bits_up"]) for r in alive)
    ratio = None
    if dense_bits_per_step and bits_up > 0:
        ratio = step * dense_bits_per_step / bits_up
    return Summary(
        time=now,
        global_step=step,
        alive_peers=len(alive),
        samples_per_s=sum(float(r["samples_per_s"]) for r in alive),
        metric=statistics.median(at_step) if at_step else None,
        metric_name=str(alive[0]["metric_name"]),
        bits_up=bits_up,
        bits_down=statistics.fmean(float(r["bits_down"]) for r in alive),
        wire_sent=statistics.fmean(float(r["wire_sent"]) for r in alive),
        wire_received=statistics.fmean(float(r["wire_received"]) for r in alive),
        compression_ratio=ratio,
    )
