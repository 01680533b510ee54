"""`collab validate` and `collab simulate` as a user runs them (separate processes)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tests.conftest import CONFIGS, run_cli


def test_validate_ok_and_bad(tmp_path: Path) -> None:
    ok = run_cli("validate", str(CONFIGS / "bilinear.yaml"))
    assert ok.returncode == 0 and ok.stdout.strip() == "ok"
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: {name: masha1, gamma: 0}\nnum_devices: -3\nextra_field: 1\n")
    res = run_cli("validate", str(bad))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 3, res.stderr
    assert any("method.gamma" in line for line in lines) and any("num_devices" in line for line in lines)
    assert "Traceback" not in res.stderr
    missing = run_cli("validate", str(tmp_path / "nope.yaml"))
    assert (
        missing.returncode == 2
        and "cannot read config" in missing.stderr
        and "Traceback" not in missing.stderr
    )


def test_simulate_json_and_metrics(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.csv"
    # the demo's config: it reaches its target in ~110 steps (the paper's comparison is the next test)
    res = run_cli("simulate", "--config", str(CONFIGS / "demo.yaml"), "--json", "--metrics", str(metrics))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("method", "steps", "final_rel_distance", "bits_per_device", "bits_to_target"):
        assert key in out
    assert out["method"] == "masha1" and out["final_rel_distance"] <= 1e-6
    assert out["bits_to_target"] is not None and out["bits_to_target"] <= out["bits_per_device"]
    rows = list(csv.DictReader(metrics.open()))
    assert rows[0]["step"] == "0" and float(rows[0]["rel_distance"]) == 1.0
    assert int(rows[-1]["step"]) == out["steps"]
    assert [float(r["bits_per_device"]) for r in rows] == sorted(float(r["bits_per_device"]) for r in rows)


def test_simulate_overrides_and_compare(tmp_path: Path) -> None:
    res = run_cli(
        "simulate", "--config", str(CONFIGS / "bilinear.yaml"), "--method", "masha2", "--ratio", "0.3",
        "--max-steps", "5", "--json", "--metrics", str(tmp_path / "m.csv"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["method"] == "masha2" and out["device_compressor"] == "topk" and out["ratio"] == 0.3
    assert out["steps"] == 5 and out["bits_to_target"] is None
    plot = tmp_path / "cmp.png"
    res = run_cli(
        "simulate", "--config", str(CONFIGS / "bilinear.yaml"), "--compare", "--plot", str(plot), "--json",
        "--metrics", str(tmp_path / "c.csv"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    savings = out["savings_vs_extragradient"]
    assert savings["extragradient"] == 1.0
    assert all(v is not None and v > 1.05 for k, v in savings.items() if k != "extragradient")
    assert max(savings.values()) > 2.0
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert "saving" in res.stdout


def test_bad_override_is_one_line() -> None:
    res = run_cli("simulate", "--config", str(CONFIGS / "bilinear.yaml"), "--gamma", "-1")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "method.gamma" in res.stderr


def test_help_lists_subcommands() -> None:
    res = run_cli("--help")
    assert res.returncode == 0 and "simulate" in res.stdout and "validate" in res.stdout
    res = run_cli("simulate", "--help")
    assert res.returncode == 0 and "--compare" in res.stdout and "--plot" in res.stdout
