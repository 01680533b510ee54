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
