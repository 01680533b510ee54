"""The monitor's aggregation on hand-made records."""

from __future__ import annotations

from typing import Any

import pytest

from monitor.aggregate import BadRecord, summarize, validate_record


def rec(**changes: Any) -> dict[str, Any]:
    base = {
        "step": 10, "samples": 160, "samples_per_s": 8.0, "metric": 0.5, "metric_name": "loss",
        "bits_up": 1000.0, "bits_down": 2000.0, "wire_sent": 500, "wire_received": 700, "group_size": 3,
        "round_share": 0.3, "device": "cpu", "client_mode": False, "config_version": "v1", "name": "a",
        "time": 100.0,
    }  # fmt: skip
    base.update(changes)
    return base


def test_summary_counts_alive_peers_and_global_step() -> None:
    records = {
        "p1": rec(step=10, metric=0.5, time=100.0),
        "p2": rec(step=10, metric=0.7, time=99.0, samples_per_s=4.0, bits_up=3000.0),
        "p3": rec(step=9, metric=9.0, time=98.0),
        "gone": rec(step=50, time=10.0),  # not heard from for 90 s: not alive, its step does not count
    }
    s = summarize(records, now=100.0, alive_window_s=30.0, dense_bits_per_step=64 * 100)
    assert s.alive_peers == 3 and s.global_step == 10
    assert s.metric == pytest.approx(0.6)  # median of the peers at the global step
    assert s.samples_per_s == pytest.approx(20.0)
    assert s.bits_up == pytest.approx((1000 + 3000 + 1000) / 3)
    assert s.compression_ratio == pytest.approx(10 * 6400 / s.bits_up)


def test_empty_swarm() -> None:
    s = summarize({"old": rec(time=0.0)}, now=100.0, alive_window_s=5.0)
    assert s.alive_peers == 0 and s.metric is None and s.compression_ratio is None


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [1, 2],
        rec(step=-1),
        rec(step="10"),
        rec(client_mode="no"),
        rec(step=True),
        {k: v for k, v in rec().items() if k != "metric"},
    ],
)
def test_bad_records_are_rejected(bad: Any) -> None:
    with pytest.raises(BadRecord):
        validate_record(bad)


def test_records_of_another_config_are_rejected() -> None:
    assert validate_record(rec(), config_version="v1")["step"] == 10
    with pytest.raises(BadRecord, match="another config"):
        validate_record(rec(), config_version="v2")
