"""Keep the run's model: follow the swarm without training, write versioned checkpoints and a gallery.

Every --every steps (and at the run's last step) downloads the state of the most advanced volunteer,
checks its hash, config version, method and shapes, and writes OUT/step-NNNNNN.ckpt atomically (usable
as it is by `collab generate --checkpoint` and `collab export`). For text2image runs it then draws
--samples images for each of the config's gallery prompts into OUT/gallery/ (shown on the dashboard with
`collab monitor --gallery OUT/gallery`; `collab coordinator --keep-model OUT` does all of this itself).

It never slows the volunteers: it takes part in no round, is never asked for the state, connects out
only (client mode), downloads at most once per --every steps, and runs at low CPU priority on one thread.
Stops by itself once the run's last step is kept; Ctrl-C stops it at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collab.config import RunConfig
from peers.common import EXIT_BAD_INPUT, task_problem

if TYPE_CHECKING:
    from collab.methods.base import Method, MethodState
    from collab.swarm.transport import SwarmNode

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from peers.join import add_run_source_arguments

    add_run_source_arguments(p)
    p.add_argument("--out", required=True, metavar="DIR", help="folder for checkpoints (and gallery/)")
    p.add_argument(
        "--every", type=int, metavar="N", help="steps between checkpoints (default: a tenth of the run)"
    )
    p.add_argument(
        "--keep-last", type=int, default=0, metavar="K", help="keep only the newest K checkpoints (0: all)"
    )
    p.add_argument("--samples", type=int, default=4, help="gallery samples per prompt (default 4)")
    p.add_argument("--host", default="127.0.0.1", help="address of this peer (default 127.0.0.1)")
    p.add_argument(
        "--nice", type=int, default=10, help="CPU priority increment (default 10: yield to others)"
    )


class KeeperError(RuntimeError):
    """A problem to report in one line."""


def connect(args: argparse.Namespace, cfg: RunConfig, peers: list[str], name: str) -> SwarmNode:
    """A client-mode node in the run (with access credentials for invite-only runs); raises
    :class:`KeeperError` with one line."""
    from collab.swarm import SwarmNode
    from collab.swarm.records import make_validators
    from peers.access_client import AccessError, obtain_access

    validators, _ = make_validators(cfg.run_id)
    try:
        access = obtain_access(args, cfg, name)
    except AccessError as e:
        raise KeeperError(str(e)) from None
    try:
        return SwarmNode(
            initial_peers=peers,
            host=getattr(args, "host", "127.0.0.1"),
            port=0,
            client_mode=True,
            max_message_bytes=cfg.swarm.max_message_bytes,
            record_validators=validators,
            access=access,
        )
    except Exception as e:  # hivemind reports unreachable peers and bad addresses in several ways
        raise KeeperError(f"cannot join the swarm: {e}") from None


def follower_method(cfg: RunConfig) -> tuple[Any, Method]:
    """The run's task and a method of it that is never stepped: downloaded states are checked by
    adopting them into it."""
    from collab.methods.build import build_method
    from collab.methods.simulated import SimulatedAggregator
    from collab.tasks.build import build_task

    task = build_task(cfg)
    return task, build_method(cfg, task, SimulatedAggregator(num_devices=1), [0])


def _on_kept(cfg: RunConfig, task: Any, out: Path, samples: int) -> Any:
    """Say what was kept; for text2image runs with gallery prompts also draw them into ``out/gallery``."""
    from collab.swarm.keeper import checkpoint_name

    prompts = list(cfg.task.prompts) if cfg.task.name == "text2image" else []

    def kept(state: MethodState) -> None:
        line = f"keeper: step {state.step} kept in {out / checkpoint_name(state.step)}"
        if prompts:
            from collab import gallery
            from collab.tasks import text2image

            model, _ = task.unflatten(state.z)
            images = text2image.gallery_images(model, prompts, n=samples, seed=state.step)
            gallery.add_entry(out / "gallery", state.step, images)
            good = sum(m for _, _, _, m in images)
            line += f"; gallery: {good} of {samples * len(prompts)} samples show their prompt's scene"
        print(line, flush=True)

    return kept


def run(args: argparse.Namespace) -> int:
    from peers.join import resolve_run

    if args.every is not None and args.every < 1:
        print("--every: must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.keep_last < 0 or not 1 <= args.samples <= 64:
        print("--keep-last must be >= 0 and --samples between 1 and 64", file=sys.stderr)
        return EXIT_BAD_INPUT
    resolved = resolve_run(args)
    if isinstance(resolved, int):
        return resolved
    cfg, peers = resolved
    problem = task_problem(cfg)
    if problem is not None:
        print(problem, file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"--out: cannot create {out}: {e.strerror}", file=sys.stderr)
        return 1
    if args.nice > 0:
        os.nice(min(args.nice, 19))
    import torch

    torch.set_num_threads(1)
    from collab.swarm.keeper import ModelKeeper

    task, method = follower_method(cfg)
    every = args.every or max(1, cfg.max_steps // 10)
    try:
        node = connect(args, cfg, peers, "keeper")
    except KeeperError as e:
        print(str(e), file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        keeper = ModelKeeper(
            cfg,
            node,
            method=method,
            folder=out,
            every=every,
            keep_last=args.keep_last,
            on_state=_on_kept(cfg, task, out, args.samples),
        )
        print(f"keeper: run {cfg.run_id}, a checkpoint every {every} steps in {out}", flush=True)
        last = keeper.run(stop)
        print(f"keeper: stopped; last kept step {last}", flush=True)
    finally:
        node.shutdown()
    return 0


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["keeper", *sys.argv[1:]]))
