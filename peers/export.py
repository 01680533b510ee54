"""Export a checkpoint's model: a `transformers` folder (from_pretrained) or a safetensors state_dict.

Reads a checkpoint written by `collab join --checkpoint PATH` (checked: format, hash, config) and the run
config embedded in it (or --config FILE for a checkpoint written without one; its version must be the
checkpoint's), builds the task's model at the checkpoint's parameters and writes into --out DIR:

  config.json, model.safetensors   a transformers model, as save_pretrained writes it (from_pretrained
                                   reads it back); any other PyTorch model: model.safetensors holding its
                                   plain state_dict (model.load_state_dict(safetensors.torch.load_file(..)))
  adversary.safetensors            the adversary's own tensors (min-max tasks that have them)
  collab.json                      run_id, step, state hash, config version, method and the run config

Files of these names in DIR are replaced. The bilinear task has no model to export. Bad input (a
missing or damaged checkpoint, a config of another run, a folder that cannot be written) is one line on
stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collab.config import RunConfig
from peers.common import EXIT_BAD_INPUT, load_config_or_exit

if TYPE_CHECKING:  # torch and transformers load only when an export runs
    from collab.methods.checkpoint import Checkpoint

MODEL_FILE = "model.safetensors"
ADVERSARY_FILE = "adversary.safetensors"
INFO_FILE = "collab.json"


class ExportError(ValueError):
    """An export that cannot be done; the message is one line naming the problem."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint", required=True, metavar="PATH", help="checkpoint of `collab join --checkpoint`"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (created if missing)")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="the run's config, for a checkpoint written without one (must be the checkpoint's version)",
    )


def _run_config(ck: Checkpoint, path: str, cfg: RunConfig | None, config_path: str | None) -> RunConfig:
    """The checkpoint's run config: the embedded one, or ``cfg`` (from --config) if its version fits."""
    if cfg is not None and cfg.version() != ck.config_version:
        raise ExportError(
            f"{config_path}: config version {cfg.version()} is not the checkpoint's "
            f"({ck.config_version[:16]}); pass the config of the run that wrote it"
        )
    if ck.config is not None:
        return ck.config
    if cfg is None:
        raise ExportError(
            f"checkpoint {path} holds no run config (written by an older collab); pass --config FILE with "
            "the run's config"
        )
    return cfg


def _snapshot(out: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in out.iterdir() if p.is_file()}


def export_checkpoint(
    path: str, out: str, *, cfg: RunConfig | None = None, config_path: str | None = None
) -> str:
    """Write the model of the checkpoint at ``path`` into ``out``; returns the line to print.

    Raises :class:`ExportError` (or :class:`~collab.methods.checkpoint.CheckpointError`) with one line.
    """
    from collab.methods.checkpoint import open_checkpoint
    from collab.tasks.build import build_task
    from collab.tasks.torch_task import FactoryError, TorchTask

    ck = open_checkpoint(path)
    run_cfg = _run_config(ck, path, cfg, config_path)
    if run_cfg.task.name == "bilinear":
        raise ExportError(f"task {run_cfg.task.name} has no model to export")
    try:
        task = build_task(run_cfg)
    except FactoryError as e:
        raise ExportError(f"cannot build the checkpoint's task: {e}") from None
    except Exception as e:  # the organizer's factory failed: report it in one line, not as our crash
        raise ExportError(f"cannot build the checkpoint's task: {type(e).__name__}: {e}") from None
    if not isinstance(task, TorchTask):
        raise ExportError(f"task {run_cfg.task.name} has no model to export")
    z = ck.state.z
    if z.numel() != task.dim:
        raise ExportError(
            f"checkpoint {path} does not fit its task ({z.numel()} parameters, the task has {task.dim})"
        )
    model, adversary = task.unflatten(z)
    # A transformers model imports transformers; any other model needs no import to be told apart.
    hf = sys.modules.get("transformers")
    is_hf = hf is not None and isinstance(model, hf.PreTrainedModel)
    kind = f"{type(model).__name__}, transformers save_pretrained" if is_hf else "state_dict, safetensors"
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        before = _snapshot(folder)
        _write(folder, model, adversary, is_hf, _info(ck, run_cfg, "transformers" if is_hf else "state_dict"))
        after = _snapshot(folder)
    except OSError as e:
        raise ExportError(f"cannot write to {out} ({type(e).__name__}: {e})") from None
    written = sorted(name for name, stamp in after.items() if before.get(name) != stamp)
    return f"exported run {run_cfg.run_id} step {ck.state.step} ({kind}) to {out}: {', '.join(written)}"


def _info(ck: Checkpoint, cfg: RunConfig, fmt: str) -> dict[str, Any]:
    return {
        "run_id": cfg.run_id,
        "step": ck.state.step,
        "state_hash": ck.state.hash(),
        "config_version": ck.config_version,
        "method": ck.method,
        "task": cfg.task.name,
        "format": fmt,
        "config": cfg.model_dump(mode="json"),
    }


def _write(folder: Path, model: Any, adversary: dict[str, Any], is_hf: bool, info: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    from collab.files import atomic_write

    if is_hf:
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # the command prints one line, not a progress bar
        try:
            # safetensors is save_pretrained's default (transformers >= 4.35; v5 dropped the switch).
            model.save_pretrained(folder)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
    else:
        # clone: tied tensors share memory, which save_file refuses; each key gets its own copy, so the
        # file is a complete state_dict for load_state_dict.
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(folder / MODEL_FILE), metadata={"format": "pt"})
    if adversary:
        tensors = {k: v.detach().clone().contiguous() for k, v in adversary.items()}
        save_file(tensors, str(folder / ADVERSARY_FILE), metadata={"format": "pt"})
    else:
        (folder / ADVERSARY_FILE).unlink(missing_ok=True)  # never leave another export's adversary here
    atomic_write(folder / INFO_FILE, (json.dumps(info, indent=2, sort_keys=True) + "\n").encode())


def run(args: argparse.Namespace) -> int:
    cfg = None
    if args.config is not None:
        cfg = load_config_or_exit(args.config)
        if cfg is None:
            return EXIT_BAD_INPUT
    from collab.methods.checkpoint import CheckpointError

    try:
        line = export_checkpoint(args.checkpoint, args.out, cfg=cfg, config_path=args.config)
    except (ExportError, CheckpointError) as e:
        print(" ".join(str(e).splitlines()), file=sys.stderr)  # a factory's message may span lines
        return EXIT_BAD_INPUT
    print(line)
    return 0


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["export", *sys.argv[1:]]))
