"""`collab validate` and `collab simulate` as a user runs them (separate processes)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

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
    res = run_cli("simulate", "--config", str(CONFIGS / "bilinear.yaml"), "--json", "--metrics", str(metrics))
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


CHAR = "examples.charlm:char_gpt"
_TORCH_RUN = """run_id: x
seed: 0
num_devices: 2
max_steps: 50
task: {{name: torch, factory: "{factory}", options: {{}}}}
method:
  name: masha2
  gamma: 0.003
  tau: 0.9
  device_compressor: {{name: topk, ratio: 0.05}}
  optimizer: {optimizer}
"""


@pytest.mark.parametrize(
    ("factory", "optimizer", "field"),
    [
        (CHAR, "{name: adagrad}", "method.optimizer.name"),
        (CHAR, "{name: adam, beta1: 1.5}", "method.optimizer.beta1"),
        (CHAR, "{name: adamw, weight_decay: -0.1}", "method.optimizer.weight_decay"),
        (CHAR, "{name: adam, clip_norm: 0}", "method.optimizer.clip_norm"),
        (CHAR, "{name: adam, schedule: {name: step}}", "method.optimizer.schedule.name"),
        (
            CHAR,
            "{name: adam, schedule: {name: cosine, warmup_steps: 80, total_steps: 40}}",
            "method.optimizer.schedule.warmup_steps",
        ),
        (CHAR, "{name: lamb, schedule: {min_ratio: 2}}", "method.optimizer.schedule.min_ratio"),
        ("no-colon", "{name: adam}", "factory"),
        ("no_such_package.models:build", "{name: adam}", "task.factory: module 'no_such_package'"),
        ("os:system", "{name: adam}", "task.factory: os:system is not a collab task factory"),
        ("examples.charlm:nope", "{name: adam}", "task.factory: module examples.charlm has no 'nope'"),
    ],
)
def test_validate_rejects_bad_optimizer_and_factory(
    tmp_path: Path, factory: str, optimizer: str, field: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(_TORCH_RUN.format(factory=factory, optimizer=optimizer))
    res = run_cli("validate", str(path))
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_validate_accepts_the_examples() -> None:
    for path in (
        CONFIGS / "adversarial.yaml",
        CONFIGS / "text2image.yaml",
        CONFIGS.parent / "examples" / "charlm.yaml",
    ):
        res = run_cli("validate", str(path))
        assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"prompts": ["a purple ring top left on black"]}, "task.prompts.0: unknown words ['purple']"),
        ({"train_scenes": 2}, "task.train_scenes (2) must be at least num_devices (3)"),
        ({"hidden": 30, "heads": 4}, "heads must divide hidden"),
    ],
)
def test_validate_rejects_bad_text2image_settings(
    tmp_path: Path, change: dict[str, object], needle: str
) -> None:
    data = yaml.safe_load((CONFIGS / "text2image.yaml").read_text())
    data["task"].update(change)
    path = tmp_path / "t2i.yaml"
    path.write_text(yaml.safe_dump(data))
    res = run_cli("validate", str(path))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr
