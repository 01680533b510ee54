"""`collab export`: a checkpoint's model comes back with `from_pretrained` (or `load_state_dict`) and gives
the same outputs as the task's model at the checkpoint's parameters; bad input is one line and exit 2.

Checkpoints are made in-process: a few simulated steps of a tiny task (so ``z`` is no longer the initial
point), encoded with the run config. The command runs through ``peers.cli.main`` in this process (the
argument parsing, messages and exit codes of the real command; tests/e2e/test_export_cli.py runs it as a
separate process).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from collab.config import RunConfig, parse_config
from collab.methods.base import MethodState
from collab.methods.build import build_method
from collab.methods.checkpoint import encode_checkpoint
from collab.methods.simulated import SimulatedAggregator
from collab.tasks import TorchProblem, task_factory
from collab.tasks.build import build_task
from collab.tasks.torch_task import TorchTask
from peers.cli import main

CHARLM = {
    "run_id": "export-charlm",
    "task": {
        "name": "torch",
        "factory": "examples.charlm:char_gpt",
        "options": {"seq_len": 16, "layers": 1, "hidden": 16, "heads": 2},
        "batch_size": 4,
    },
    "method": {
        "name": "masha2",
        "gamma": 0.003,
        "device_compressor": {"name": "topk", "ratio": 0.1},
        "optimizer": {"name": "adam"},
    },
    "num_devices": 2,
    "max_steps": 3,
}
ALBERT = {
    "run_id": "export-albert",
    "task": {
        "name": "adversarial",
        "seq_len": 8,
        "batch_size": 2,
        "embedding_size": 8,
        "hidden_size": 16,
        "layers": 1,
        "heads": 2,
    },
    "method": {"name": "masha1", "gamma": 0.01, "device_compressor": {"name": "randk", "ratio": 0.2}},
    "num_devices": 2,
    "max_steps": 3,
}
TINY = {
    "run_id": "export-tiny",
    "task": {"name": "torch", "factory": "tests.unit.test_export:tiny", "batch_size": 4},
    "method": {"name": "masha1", "gamma": 0.05, "device_compressor": {"name": "randk", "ratio": 0.5}},
    "num_devices": 2,
    "max_steps": 3,
}
BILINEAR = {"run_id": "export-bilinear", "task": {"name": "bilinear", "dim": 4}, "method": {"gamma": 0.1}}


def _tiny_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


@task_factory
def tiny(*, seed: int) -> TorchProblem:
    """A model that is not a transformers model: its export is a plain state_dict."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(32, 4, generator=g)
    ys = xs.sum(dim=1, keepdim=True)
    return TorchProblem(
        model=_tiny_net(),
        loss=lambda model, batch, adversary: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
        data=lambda shard, num_shards: list(zip(xs, ys, strict=True))[shard::num_shards],
        collate=lambda examples, generator: tuple(torch.stack(t) for t in zip(*examples, strict=True)),
        eval_batch=(xs[:8], ys[:8]),
    )


def _trained(data: dict[str, Any], steps: int = 2) -> tuple[RunConfig, TorchTask, MethodState]:
    cfg = parse_config(data)
    task = build_task(cfg)
    assert isinstance(task, TorchTask)
    method = build_method(cfg, task, SimulatedAggregator(num_devices=cfg.num_devices), range(cfg.num_devices))
    method.initialize()
    for _ in range(steps):
        method.step()
    assert method.state is not None and method.state.step == steps
    assert not torch.equal(method.state.z, task.initial_point()), "the steps moved the parameters"
    return cfg, task, method.state


def _write(path: Path, cfg: RunConfig, state: MethodState, *, embed: bool = True) -> Path:
    config = cfg if embed else None
    path.write_bytes(
        encode_checkpoint(state, config_version=cfg.version(), method=cfg.method.name, config=config)
    )
    return path


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["export", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def charlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunConfig, TorchTask, MethodState]:
    cfg, task, state = _trained(CHARLM)
    return _write(tmp_path_factory.mktemp("charlm") / "peer.ckpt", cfg, state), cfg, task, state


def test_transformers_model_loads_back_with_the_same_outputs(
    charlm: tuple[Path, RunConfig, TorchTask, MethodState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    ckpt, cfg, task, state = charlm
    out = tmp_path / "charlm-export"
    rc, stdout, err = _export(capsys, "--checkpoint", str(ckpt), "--out", str(out))
    assert rc == 0 and err == "", err
    assert stdout.splitlines() == [
        f"exported run export-charlm step 2 (GPT2LMHeadModel, transformers save_pretrained) to {out}: "
        + ", ".join(sorted(p.name for p in out.iterdir()))
    ]
    assert {"config.json", "model.safetensors", "collab.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "adversary.safetensors").exists(), "minimization: no adversary"
    info = json.loads((out / "collab.json").read_text())
    assert info["run_id"] == "export-charlm" and info["step"] == 2 and info["state_hash"] == state.hash()
    assert info["config_version"] == cfg.version() and info["format"] == "transformers"
    assert parse_config(info["config"]) == cfg

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "GPT2LMHeadModel" and not loaded.training
    model, adversary = task.unflatten(state.z)
    assert adversary == {}
    batch = {k: v for k, v in task.problem.eval_batch.items() if k != "labels"}
    with torch.no_grad():
        expected, got = model(**batch).logits, loaded(**batch).logits
    assert torch.equal(got, expected), (got - expected).abs().max()
    initial = task.unflatten(task.initial_point())[0]  # the same module, now at the initial point
    with torch.no_grad():
        assert not torch.allclose(initial(**batch).logits, got, atol=1e-6), "exported z, not the init"


def test_adversarial_task_exports_albert_and_the_adversary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForMaskedLM

    cfg, task, state = _trained(ALBERT, steps=1)
    ckpt = _write(tmp_path / "albert.ckpt", cfg, state)
    out = tmp_path / "albert-export"
    rc, stdout, err = _export(capsys, "--checkpoint", str(ckpt), "--out", str(out))
    assert rc == 0 and err == "", err
    assert "(AlbertForMaskedLM, transformers save_pretrained)" in stdout and "adversary.safetensors" in stdout
    model, adversary = task.unflatten(state.z)
    saved = load_file(out / "adversary.safetensors")
    assert list(saved) == ["delta"] and torch.equal(saved["delta"], adversary["delta"])
    assert saved["delta"].abs().sum() > 0, "the adversary moved"
    loaded = AutoModelForMaskedLM.from_pretrained(out)
    ids = task.problem.eval_batch[0]  # (masked ids, labels)
    with torch.no_grad():
        expected, got = model(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert torch.equal(got, expected), (got - expected).abs().max()


def test_other_models_export_a_plain_state_dict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg, task, state = _trained(TINY)
    ckpt = _write(tmp_path / "tiny.ckpt", cfg, state)
    out = tmp_path / "tiny-export"
    out.mkdir()
    (out / "adversary.safetensors").write_bytes(b"stale")  # another export's: must not stay
    rc, stdout, err = _export(capsys, "--checkpoint", str(ckpt), "--out", str(out))
    assert rc == 0 and err == "", err
    assert stdout.strip().endswith(f"(state_dict, safetensors) to {out}: collab.json, model.safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["collab.json", "model.safetensors"]
    net = _tiny_net()
    net.load_state_dict(load_file(out / "model.safetensors"))
    model, _ = task.unflatten(state.z)
    x = task.problem.eval_batch[0]
    with torch.no_grad():
        assert torch.equal(net(x), model(x))
    assert json.loads((out / "collab.json").read_text())["format"] == "state_dict"


def test_checkpoint_without_config_needs_the_matching_config_file(
    charlm: tuple[Path, RunConfig, TorchTask, MethodState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, cfg, _, state = charlm
    ckpt = _write(tmp_path / "old.ckpt", cfg, state, embed=False)
    rc, stdout, err = _export(capsys, "--checkpoint", str(ckpt), "--out", str(tmp_path / "a"))
    assert (rc, stdout) == (2, "")
    assert err.splitlines() == [
        f"checkpoint {ckpt} holds no run config (written by an older collab); pass --config FILE with "
        "the run's config"
    ]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**CHARLM, "seed": 1}))
    rc, stdout, err = _export(
        capsys, "--checkpoint", str(ckpt), "--out", str(tmp_path / "b"), "--config", str(other)
    )
    assert (rc, stdout) == (2, "") and len(err.splitlines()) == 1
    assert err.startswith(f"{other}: config version ") and "not the checkpoint's" in err
    same = tmp_path / "same.json"
    same.write_text(json.dumps(CHARLM))
    rc, stdout, err = _export(
        capsys, "--checkpoint", str(ckpt), "--out", str(tmp_path / "c"), "--config", str(same)
    )
    assert rc == 0 and err == "" and (tmp_path / "c" / "config.json").exists()


def _flipped(path: Path) -> bytes:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    return bytes(data)


@pytest.mark.parametrize(
    "case,expected",
    [
        ("missing", "checkpoint {ckpt} does not exist; not loaded"),
        ("flipped", "checkpoint {ckpt} is corrupt (hash mismatch); not loaded"),
        ("not_checkpoint", "checkpoint {ckpt} is corrupt (not a collab checkpoint); not loaded"),
        ("bilinear", "task bilinear has no model to export"),
        ("out_is_file", "cannot write to {out} (FileExistsError: "),
        ("out_under_file", "cannot write to {out} (NotADirectoryError: "),
        ("bad_config_file", "{config}: "),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    charlm: tuple[Path, RunConfig, TorchTask, MethodState],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    expected: str,
) -> None:
    good = charlm[0]
    ckpt, out, config = tmp_path / "peer.ckpt", tmp_path / "out", tmp_path / "run.yaml"
    extra: list[str] = []
    if case == "flipped":
        ckpt.write_bytes(_flipped(good))
    elif case == "not_checkpoint":
        ckpt.write_text("hello\n" * 10)
    elif case == "bilinear":
        bilinear = parse_config(BILINEAR)
        zero = torch.zeros(8)
        _write(ckpt, bilinear, MethodState(step=1, z=zero, w=zero, fw=zero))
    elif case != "missing":
        ckpt.write_bytes(good.read_bytes())
    if case == "out_is_file":
        out.write_text("x")
    elif case == "out_under_file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "out"
    elif case == "bad_config_file":
        config.write_text("method: {gamma: -1}\n")
        extra = ["--config", str(config)]
    rc, stdout, err = _export(capsys, "--checkpoint", str(ckpt), "--out", str(out), *extra)
    assert (rc, stdout) == (2, ""), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(expected.format(ckpt=ckpt, out=out, config=config)), err
