"""The monitor's SQLite history: written, queried, and still there after a restart."""

from __future__ import annotations

from pathlib import Path

from monitor.aggregate import summarize
from monitor.store import MonitorStore
from tests.unit.test_monitor_aggregate import rec


def test_history_survives_restart(tmp_path: Path) -> None:
    db = tmp_path / "runs" / "monitor.sqlite"
    store = MonitorStore(db)
    for t in range(5):
        records = {"p1": rec(step=t, time=100.0 + t), "p2": rec(step=t, time=100.0 + t, name="b")}
        store.add_summary(summarize(records, now=100.0 + t, alive_window_s=10.0))
        for peer, r in records.items():
            store.upsert_contributor(peer, r | {"samples": 16 * (t + 1)})
    store.reject(101.0, "evil", "field 'step' missing or not int")
    store.close()

    again = MonitorStore(db)
    history = again.history()
    assert [h["global_step"] for h in history] == [0, 1, 2, 3, 4]
    assert [h["global_step"] for h in again.history(since=102.0)] == [3, 4]
    people = again.contributors()
    assert {p["peer"] for p in people} == {"p1", "p2"}
    assert all(p["samples"] == 80 and p["steps"] == 4 and p["uptime_s"] == 4.0 for p in people)
    assert again.rejected_count() == 1
    again.close()


def test_bans_are_stored_once_and_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite"
    store = MonitorStore(path)
    ban = {
        "peer": "12D3KooWbad",
        "reason": "3 non-finite value(s)",
        "round_id": "4.delta",
        "time": 100.0,
        "until": 700.0,
    }
    assert store.add_ban("reporter-a", "alice", ban)
    assert not store.add_ban("reporter-a", "alice", ban), "the same report read twice is one event"
    assert store.add_ban("reporter-b", "bob", {**ban, "time": 101.0})
    store.close()
    store = MonitorStore(path)
    assert [b["reporter_name"] for b in store.bans()] == ["bob", "alice"]
    assert store.banned_peers(now=500.0) == 1 and store.banned_peers(now=800.0) == 0
    store.close()
