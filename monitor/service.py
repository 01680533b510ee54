"""The monitor peer: polls the run's signed progress records from the DHT, aggregates, stores history.

It joins the DHT like any peer (with the run's record validators, so unsigned or malformed records are
refused at the DHT layer) and is a reader only: it never takes part in rounds.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Protocol

from collab.config import RunConfig
from collab.swarm.records import bans_key, dht_time, progress_key
from monitor.aggregate import BadRecord, Summary, summarize, validate_record
from monitor.store import MonitorStore

logger = logging.getLogger(__name__)


class RecordSource(Protocol):
    """Where records come from: a ``SwarmNode`` (embedded monitor) or a ``DhtReader`` (standalone)."""

    def get_dict(self, key: str, *, timeout_s: float) -> dict[str, Any]: ...


class Monitor:
    """``Monitor(cfg, node, store).start()``; ``latest``/``peers`` hold the newest picture."""

    def __init__(
        self,
        cfg: RunConfig,
        node: RecordSource,
        store: MonitorStore,
        *,
        poll_interval_s: float = 1.0,
        alive_window_s: float | None = None,
    ) -> None:
        self.cfg, self.node, self.store = cfg, node, store
        self.poll_interval_s = poll_interval_s
        self.alive_window_s = alive_window_s or max(10.0, 3 * cfg.swarm.heartbeat_ttl_s)
        self.dense_bits_per_step = 64.0 * self._dim()
        self.latest: Summary | None = None
        self.peers: dict[str, dict[str, Any]] = {}
        self.rejected: dict[str, str] = {}
        self._seen_bad: set[tuple[str, str]] = set()
        self._last_time = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="collab-monitor", daemon=True)

    def _dim(self) -> int:
        t = self.cfg.task
        return 2 * t.dim if t.name == "bilinear" else 0

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def poll_once(self) -> Summary:
        raw = self.node.get_dict(progress_key(self.cfg.run_id), timeout_s=15.0)
        valid: dict[str, dict[str, Any]] = {}
        for peer, record in raw.items():
            key = hashlib.sha256(str(peer).encode()).hexdigest()[:16]  # a short, stable id of the public key
            try:
                valid[key] = validate_record(record, config_version=self.cfg.version())
            except BadRecord as e:
                if (key, str(e)) not in self._seen_bad:  # count each distinct bad record once
                    self._seen_bad.add((key, str(e)))
                    self.rejected[key] = str(e)
                    self.store.reject(dht_time(), key, str(e))
                    logger.info("monitor: ignored a record from %s: %s", key, e)
        now = dht_time()
        summary = summarize(
            valid,
            now=now,
            alive_window_s=self.alive_window_s,
            dense_bits_per_step=self.dense_bits_per_step or None,
        )
        for peer, record in valid.items():
            self.store.upsert_contributor(peer, record)
        self._poll_bans()
        if summary.global_step and summary.time > self._last_time:
            self.store.add_summary(summary)
            self._last_time = summary.time
        self.latest, self.peers = summary, valid
        return summary

    def _poll_bans(self) -> None:
        """Store the ban events peers report (signed records: a peer reports only its own bans)."""
        for reporter, report in self.node.get_dict(bans_key(self.cfg.run_id), timeout_s=15.0).items():
            if not isinstance(report, dict) or not isinstance(report.get("bans"), list):
                continue
            key = hashlib.sha256(str(reporter).encode()).hexdigest()[:16]
            for ban in report["bans"]:
                try:
                    if self.store.add_ban(key, str(report.get("name", "?")), ban):
                        logger.info("monitor: %s banned %s: %s", report.get("name"), ban["peer"], ban)
                except (KeyError, TypeError, ValueError) as e:
                    logger.info("monitor: ignored a malformed ban report from %s: %s", key, e)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as e:  # the DHT being slow is not fatal: try again next poll
                logger.warning("monitor poll failed: %s", e)
            self._stop.wait(self.poll_interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def peer_table(self) -> list[dict[str, Any]]:
        now = time.time()
        out = []
        for peer, r in sorted(self.peers.items(), key=lambda kv: kv[1]["name"]):
            out.append(
                {
                    "peer": peer,
                    "name": r["name"],
                    "device": r["device"],
                    "step": r["step"],
                    "samples_per_s": round(r["samples_per_s"], 1),
                    "round_share": round(r["round_share"], 3),
                    "last_seen_s": round(max(0.0, now - r["time"]), 1),
                    "client_mode": r["client_mode"],
                    "alive": now - r["time"] <= self.alive_window_s,
                }
            )
        return out
