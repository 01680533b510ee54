"""Draw images from a text-to-image model: a PNG grid of samples for a prompt.

Reads a checkpoint of a `text2image` run (`collab join --checkpoint PATH` or the model keeper's
step-NNNNNN.ckpt; checked: format, hash, its embedded run config) or, with --coordinator URL, downloads
the current state of a running swarm (hash-checked, like a late joiner; --token for invite-only runs),
builds the model at those parameters and samples --n images for
--prompt, one image token at a time from the palette (--temperature 0 takes the most likely token;
--top-k keeps the k most likely). Writes --out (PNG: the samples side by side, 8 per row) and prints one
line with the step and, for every sample, whether the scene checker reads back the prompt's scene.

Prompts use the run's grammar: "a <colour> <shape> <top|bottom> <left|right> [and a ...] on
<background>". A word outside it, a checkpoint of another task, or a file that cannot be written is one
line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from peers.common import EXIT_BAD_INPUT


class GenerateError(ValueError):
    """A generation that cannot be done; one line."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="PATH", help="checkpoint of a text2image run")
    src.add_argument("--coordinator", metavar="URL", help="a running text2image run: take its current model")
    p.add_argument("--token", metavar="INVITE", help="the invite of an invite-only run (with --coordinator)")
    p.add_argument(
        "--prompt", required=True, help='e.g. "a red ring top left and a blue bar bottom right on black"'
    )
    p.add_argument("--n", type=int, default=8, help="number of samples (default 8)")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature; 0: argmax (default 1)"
    )
    p.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--out", required=True, metavar="PNG", help="image grid to write")


def generate(args: argparse.Namespace) -> str:
    """Write the grid; return the line to print. Raises GenerateError / CheckpointError with one line."""
    if not 1 <= args.n <= 256:
        raise GenerateError(f"--n must be between 1 and 256 (got {args.n})")
    if args.top_k is not None and args.top_k < 1:
        raise GenerateError(f"--top-k must be at least 1 (got {args.top_k})")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise GenerateError(f"--temperature must be a finite number >= 0 (got {args.temperature})")
    if not 0 <= args.seed < 2**63:
        raise GenerateError(f"--seed must be between 0 and 2**63 - 1 (got {args.seed})")
    from collab.tasks import scenes

    try:
        want = scenes.parse_caption(args.prompt)
    except scenes.CaptionError as e:
        raise GenerateError(f"--prompt: {e}") from None

    import torch

    from collab.tasks import text2image

    step, model = _model_from_checkpoint(args.checkpoint) if args.checkpoint else _model_from_swarm(args)
    g = torch.Generator().manual_seed(args.seed)
    images = text2image.sample(
        model, want.caption(), n=args.n, temperature=args.temperature, top_k=args.top_k, generator=g
    )
    grid = text2image.image_grid(images)
    import io

    from collab.files import atomic_write

    png = io.BytesIO()
    grid.save(png, format="PNG")
    try:
        atomic_write(args.out, png.getvalue())  # never a half-written image at --out
    except (OSError, ValueError) as e:
        raise GenerateError(f"cannot write {args.out} ({type(e).__name__}: {e})") from None
    read = sum(scenes.read_scene(im) == want for im in images)
    return (
        f"{args.n} samples of {want.caption()!r} from step {step} written to {args.out}; "
        f"{read} of {args.n} show exactly that scene"
    )


def _model_from_checkpoint(path: str) -> tuple[int, Any]:
    from collab.methods.checkpoint import open_checkpoint
    from collab.tasks.build import build_task

    ck = open_checkpoint(path)
    if ck.config is None or ck.config.task.name != "text2image":
        found = "no run config" if ck.config is None else f"task {ck.config.task.name}"
        raise GenerateError(f"checkpoint {path} is not of a text2image run ({found})")
    task = build_task(ck.config)
    if ck.state.z.numel() != task.dim:
        raise GenerateError(f"checkpoint {path} does not fit its task's model")
    model, _ = task.unflatten(ck.state.z)  # type: ignore[attr-defined]
    return ck.state.step, model


def _model_from_swarm(args: argparse.Namespace) -> tuple[int, Any]:
    """The current model of the run at ``args.coordinator``: the most advanced volunteer's state,
    hash-checked and checked against the run's method like a late joiner's download."""
    from peers.join import JoinError, fetch_run
    from peers.keeper import KeeperError, connect, follower_method

    try:
        cfg, peers = fetch_run(args.coordinator)
    except JoinError as e:
        raise GenerateError(str(e)) from None
    if cfg.task.name != "text2image":
        raise GenerateError(f"--coordinator: run {cfg.run_id} trains task {cfg.task.name}, not text2image")
    from collab.swarm.records import alive_key, parse_alive
    from collab.swarm.state_sync import StateRejected, StateSource, Vouches, alive_steps, download_state
    from collab.swarm.timing import Timing

    task, method = follower_method(cfg)
    try:
        node = connect(args, cfg, peers, "generate")
    except KeeperError as e:
        raise GenerateError(str(e)) from None
    source = StateSource(config_version=cfg.version(), method=method.name, timing=Timing.of(cfg.swarm))
    vouches = Vouches(node, cfg.run_id, source.timing, alone_ok=cfg.swarm.min_group_size < 2)
    problems: list[str] = []
    try:
        # peers publish their alive records every heartbeat: a few heartbeats tell who is there
        for _ in range(max(3, int(3 * cfg.swarm.heartbeat_ttl_s / cfg.swarm.heartbeat_interval_s))):
            try:
                alive = parse_alive(node.get_dict(alive_key(cfg.run_id), timeout_s=source.timing.dht_s))
            except Exception as e:  # hivemind reports a slow DHT in several ways: look again
                problems.append(f"the DHT did not answer: {e}")
                alive = {}
            for _step, peer in alive_steps(alive, sources=True):
                try:
                    state = download_state(node, peer, source).state
                    vouches.check(state, peer, alive)  # more than one member vouches for it
                    method.adopt_state(state)
                except (StateRejected, ValueError) as e:
                    problems.append(f"{peer[-6:]}: {e}")
                    continue
                model, _ = task.unflatten(state.z)
                return state.step, model
            time.sleep(cfg.swarm.heartbeat_interval_s)
    finally:
        node.shutdown()
    why = f" ({problems[-1]})" if problems else ": no volunteer is training it now"
    raise GenerateError(f"--coordinator: could not download the model of run {cfg.run_id}{why}")


def run(args: argparse.Namespace) -> int:
    from collab.methods.checkpoint import CheckpointError

    try:
        line = generate(args)
    except (GenerateError, CheckpointError) as e:
        print(" ".join(str(e).splitlines()), file=sys.stderr)
        return EXIT_BAD_INPUT
    print(line)
    return 0


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["generate", *sys.argv[1:]]))
