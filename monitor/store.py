"""The monitor's history in SQLite: summaries over time, per-contributor totals, rejected records, bans.

Survives restarts: a new :class:`MonitorStore` on the same file sees everything written before. Writes
are in transactions (WAL journal), so a crash never leaves a half-written row.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

from monitor.aggregate import Summary

SCHEMA = """
CREATE TABLE IF NOT EXISTS summaries (
    time REAL NOT NULL, global_step INTEGER NOT NULL, alive_peers INTEGER NOT NULL,
    samples_per_s REAL NOT NULL, metric REAL, metric_name TEXT NOT NULL,
    bits_up REAL NOT NULL, bits_down REAL NOT NULL, wire_sent REAL NOT NULL, wire_received REAL NOT NULL,
    compression_ratio REAL
);
CREATE INDEX IF NOT EXISTS summaries_time ON summaries(time);
CREATE TABLE IF NOT EXISTS contributors (
    peer TEXT PRIMARY KEY, name TEXT NOT NULL, device TEXT NOT NULL, client_mode INTEGER NOT NULL,
    samples INTEGER NOT NULL, steps INTEGER NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rejected (time REAL NOT NULL, peer TEXT, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS bans (
    reporter TEXT NOT NULL, reporter_name TEXT NOT NULL, peer TEXT NOT NULL, reason TEXT NOT NULL,
    round_id TEXT NOT NULL, time REAL NOT NULL, until REAL NOT NULL, PRIMARY KEY (reporter, peer, time)
);
"""


class MonitorStore:
    """``MonitorStore("runs/monitor.sqlite")``: append summaries, upsert contributors, count rejects."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        with self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)

    def add_summary(self, s: Summary) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO summaries VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    s.time, s.global_step, s.alive_peers, s.samples_per_s, s.metric, s.metric_name,
                    s.bits_up, s.bits_down, s.wire_sent, s.wire_received, s.compression_ratio,
                ),
            )  # fmt: skip

    def upsert_contributor(self, peer: str, record: dict[str, Any]) -> None:
        """Totals from the peer's latest record (samples and steps are cumulative on the peer)."""
        with self._lock, self._db:
            self._db.execute(
                """INSERT INTO contributors VALUES (?,?,?,?,?,?,?,?)
                   ON CONFLICT(peer) DO UPDATE SET name=excluded.name, device=excluded.device,
                   client_mode=excluded.client_mode, samples=MAX(samples, excluded.samples),
                   steps=MAX(steps, excluded.steps), last_seen=MAX(last_seen, excluded.last_seen)""",
                (
                    peer, record["name"], record["device"], int(record["client_mode"]), record["samples"],
                    record["step"], record["time"], record["time"],
                ),
            )  # fmt: skip

    def reject(self, time: float, peer: str | None, reason: str) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT INTO rejected VALUES (?,?,?)", (time, peer, reason[:500]))

    def add_ban(self, reporter: str, reporter_name: str, ban: dict[str, Any]) -> bool:
        """Record one ban event a peer reported (the same event twice is stored once); True if new."""
        with self._lock, self._db:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO bans VALUES (?,?,?,?,?,?,?)",
                (
                    reporter, reporter_name[:64], str(ban["peer"])[:128], str(ban["reason"])[:300],
                    str(ban["round_id"])[:32], float(ban["time"]), float(ban["until"]),
                ),
            )  # fmt: skip
            return cur.rowcount > 0

    def bans(self, limit: int = 200) -> list[dict[str, Any]]:
        """Ban events, newest first: who reported whom, why, and until when."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM bans ORDER BY time DESC LIMIT ?", (limit,)).fetchall()
        return [dict(r) for r in rows]

    def banned_peers(self, now: float) -> int:
        with self._lock:
            row = self._db.execute("SELECT COUNT(DISTINCT peer) FROM bans WHERE until > ?", (now,)).fetchone()
        return int(row[0])

    def history(self, since: float = 0.0, limit: int = 10_000) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM summaries WHERE time > ? ORDER BY time LIMIT ?", (since, limit)
            ).fetchall()
        return [dict(r) for r in rows]

    def last_summary(self) -> dict[str, Any] | None:
        """The newest stored summary (what the run last looked like while someone was training)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM summaries ORDER BY time DESC LIMIT 1").fetchone()
        return dict(row) if row is not None else None

    def contributors(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT *, last_seen - first_seen AS uptime_s FROM contributors ORDER BY samples DESC"
            ).fetchall()
        return [dict(r) for r in rows]

    def rejected_count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM rejected").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
