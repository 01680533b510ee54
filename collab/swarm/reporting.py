"""What a volunteer tells others: its JSON-lines event log, and its signed progress and ban records.

The log (one object per step or event) is what tests and tools read; the signed DHT records are what the
monitor reads. Publishing is fire and forget: a slow DHT never stalls training. A peer stores its progress
record at most every ``Timing.progress_every_s`` (half a heartbeat): a record made sooner waits out the
rest of that interval, and only the latest one then goes out. Each names the peer's last
``VOUCHED_STATES`` committed states, so no vouch is lost to the ones it supersedes, and a state stays
vouched for long enough for a downloader to see it (``VOUCHED_STATES`` steps: 2 s at 32 steps/s; with 16,
a run at 30 steps/s outran its model keeper, which saw none of its downloads vouched). A run faster than
half of them per interval stores at once, so no state goes unvouched whatever the speed.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hivemind.utils import get_dht_time

from collab.config import RunConfig
from collab.methods.base import CommStats
from collab.swarm.bans import BanEvent, Bans
from collab.swarm.records import (
    VOUCHED_STATES,
    BanEntry,
    BanReport,
    ProgressRecord,
    bans_key,
    progress_key,
    vouches_text,
)
from collab.swarm.timing import Timing
from collab.swarm.transport import SwarmNode


class EventLog:
    """Appends ``{"time", "peer", ...}`` lines to ``path`` (if any) and hands step records (those without
    an ``event``) to ``on_step`` (e.g. a progress bar)."""

    def __init__(self, path: str | Path | None, peer: str) -> None:
        self.peer = peer
        self.on_step: Callable[[dict[str, Any]], None] | None = None
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (closed in close())

    def emit(self, **record: Any) -> None:
        record = {"time": round(time.time(), 3), "peer": self.peer, **record}
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self.on_step is not None and "event" not in record:
            self.on_step(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Reporter:
    """Publishes this peer's signed progress record after each step and its current bans after each ban,
    and again every ``Timing.bans_republish_s`` while it holds any (a store can fail on a busy machine,
    and the DHT nodes that held the report can leave); nothing without a ``signer``."""

    def __init__(
        self, *, node: SwarmNode, cfg: RunConfig, signer: Any, name: str, device: str, client_mode: bool
    ) -> None:
        self.node, self.cfg, self.signer, self.name = node, cfg, signer, name
        self.device, self.client_mode = device, client_mode
        self.timing = Timing.of(cfg.swarm)
        self.config_version = cfg.version()
        self._bans: Bans | None = None
        self._states: deque[tuple[int, str]] = deque(maxlen=VOUCHED_STATES)  # (step, hash) it vouches for
        self._bans_stored = 0.0  # time.monotonic() of the last ban report
        self._lock = threading.Lock()
        self._stored_at = -math.inf  # time.monotonic() of the last progress store
        self._pending: tuple[dict[str, Any], float] | None = None  # the latest record, waiting its turn
        self._unstored = 0  # states vouched for since the last store

    def progress(
        self,
        *,
        step: int,
        samples: int,
        samples_per_s: float,
        metric: float,
        metric_name: str,
        stats: CommStats,
        group_size: int,
        round_share: float,
        state_hash: str | None = None,
    ) -> None:
        if self.signer is None:
            return
        if state_hash is not None:
            with self._lock:
                self._states.append((step, state_hash))
                self._unstored += 1
        from collab import __version__

        record = ProgressRecord(
            step=step,
            samples=samples,
            samples_per_s=float(samples_per_s),
            metric=float(metric),
            metric_name=metric_name,
            bits_up=float(stats.bits_up),
            bits_down=float(stats.bits_down),
            wire_sent=int(stats.wire_bytes_sent),
            wire_received=int(stats.wire_bytes_received),
            group_size=int(group_size),
            round_share=float(round_share),
            device=self.device,
            client_mode=self.client_mode,
            software_version=__version__,
            config_version=self.config_version,
            name=self.name,
            time=float(get_dht_time()),
            peer=self.node.peer_key,
            states=vouches_text(self._states),
        )
        self._publish(record.dict(), get_dht_time() + self.timing.progress_ttl_s)
        if self._bans is not None and time.monotonic() - self._bans_stored >= self.timing.bans_republish_s:
            self.bans(self._bans)

    def _publish(self, value: dict[str, Any], expiration: float) -> None:
        """Store ``value`` now, or once ``progress_every_s`` has passed since the last store (then the
        latest record held by that time)."""
        with self._lock:
            waiting = self._pending is not None
            self._pending = (value, expiration)
            urgent = self._unstored >= VOUCHED_STATES // 2  # else states would leave the record unstored
            if waiting and not urgent:  # a store is already due: it takes this record instead of the older
                return
            wait_s = 0.0 if urgent else self._stored_at + self.timing.progress_every_s - time.monotonic()
        self.node.spawn(self._store_latest(max(0.0, wait_s)))

    async def _store_latest(self, after_s: float) -> None:
        if after_s > 0:
            await asyncio.sleep(after_s)
        with self._lock:
            pending, self._pending = self._pending, None
            self._stored_at = time.monotonic()
            if pending is not None:
                self._unstored = 0
        if pending is not None:
            await self.node.dht_store(progress_key(self.cfg.run_id), self.signer.local_public_key, *pending)

    def bans(self, bans: Bans) -> None:
        if self.signer is None:
            return
        self._bans, self._bans_stored = bans, time.monotonic()
        entries = [
            BanEntry(peer=e.peer, reason=e.reason[:200], round_id=e.round_id, time=e.time, until=e.until)
            for e in bans.active()
        ]
        report = BanReport(name=self.name, bans=entries, time=float(get_dht_time()))
        expiration = get_dht_time() + self.cfg.swarm.ban_duration_s
        self.node.spawn(
            self.node.dht_store(
                bans_key(self.cfg.run_id), self.signer.local_public_key, report.dict(), expiration
            )
        )


def ban_line(event: BanEvent) -> dict[str, Any]:
    """The event-log fields of a ban."""
    return {"banned": event.peer, "reason": event.reason, "round": event.round_id}
