"""`collab validate` on optimizer, schedule, factory and text2image settings: one line naming the field.

In-process (``peers.cli.main``): many small cases; the separate-process path is covered by
tests/e2e/test_simulate_cli.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from peers.cli import main
from tests.conftest import CONFIGS


def _validate(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str, str]:
    rc = main(["validate", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


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
    tmp_path: Path, capsys: pytest.CaptureFixture[str], factory: str, optimizer: str, field: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(_TORCH_RUN.format(factory=factory, optimizer=optimizer))
    rc, out, err = _validate(capsys, path)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and field in lines[0], out + err


def test_validate_accepts_the_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for path in (
        CONFIGS / "adversarial.yaml",
        CONFIGS / "text2image.yaml",
        CONFIGS.parent / "examples" / "charlm.yaml",
    ):
        rc, out, err = _validate(capsys, path)
        assert rc == 0 and out.strip() == "ok", out + err


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"prompts": ["a purple ring top left on black"]}, "task.prompts.0: unknown words ['purple']"),
        ({"train_scenes": 2}, "task.train_scenes (2) must be at least num_devices (3)"),
        ({"hidden": 30, "heads": 4}, "heads must divide hidden"),
    ],
)
def test_validate_rejects_bad_text2image_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, object], needle: str
) -> None:
    data = yaml.safe_load((CONFIGS / "text2image.yaml").read_text())
    data["task"].update(change)
    path = tmp_path / "t2i.yaml"
    path.write_text(yaml.safe_dump(data))
    rc, out, err = _validate(capsys, path)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and needle in lines[0], out + err
