"""Join a training run as a volunteer: fetch the run config, sync the state, and train your shard.

With --coordinator the config and the DHT addresses come from the organizer's config server; with
--config a local file and --initial-peers (any peer of the run's DHT) do the same job. Picks CUDA when
present (--device auto). Ctrl-C leaves cleanly: the current round is finished or abandoned as a whole,
never half applied, and a local checkpoint is written atomically (--checkpoint); --resume starts from it
(a damaged one is reported and skipped; a swarm that is ahead of it still wins).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import zlib
from pathlib import Path
from typing import Any

from collab.config import ConfigError, RunConfig, parse_config
from peers.common import EXIT_BAD_INPUT, load_config_or_exit, task_problem
from peers.http_client import HttpError, check_url, request_json

logger = logging.getLogger(__name__)


def add_run_source_arguments(p: argparse.ArgumentParser) -> None:
    """--coordinator URL | --config FILE, plus --initial-peers: what :func:`resolve_run` reads."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--coordinator", metavar="URL", help="the run's config server, e.g. http://HOST:8000")
    src.add_argument("--config", help="a local YAML run config (the same file on every peer)")
    p.add_argument(
        "--initial-peers", nargs="+", default=[], metavar="MADDR", help="multiaddrs of the run's DHT to join"
    )
    p.add_argument("--token", metavar="INVITE", help="the invite of an invite-only run (from its organizer)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_source_arguments(p)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="compute device")
    p.add_argument("--device-index", type=int, help="which data shard to train (default: from the peer key)")
    p.add_argument(
        "--batch-size",
        type=int,
        help="samples per microbatch on this machine (tasks with minibatches; default: the run's). Your "
        "own choice: contributions are weighted by their samples, the run's config is unchanged",
    )
    p.add_argument(
        "--throttle",
        type=float,
        default=1.0,
        metavar="F",
        help="use at most this fraction of this machine's time for training (0 < F <= 1; default 1)",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="autocast the model's forward pass (the state and the aggregate stay fp32); bf16 suits CPUs "
        "and recent GPUs",
    )
    p.add_argument("--max-steps", type=int, help="stop after this step (default: the run's max_steps)")
    p.add_argument("--name", help="display name shown to others")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="TCP port to listen on (default: any free port)")
    p.add_argument(
        "--client-mode",
        action="store_true",
        help="behind NAT: listen nowhere, dial out only (takes part in rounds without owning a part)",
    )
    p.add_argument(
        "--auto-relay",
        action="store_true",
        help="behind NAT: look for libp2p relays through which other peers can reach this one",
    )
    p.add_argument(
        "--checkpoint",
        help="the local checkpoint: written every --checkpoint-every steps and on exit, read by --resume",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=50, metavar="N", help="steps between checkpoints (default 50)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="start from --checkpoint (a corrupt or foreign one is reported and skipped; a swarm that is "
        "ahead still wins)",
    )
    p.add_argument("--log-file", help="append one JSON object per step/event to this file")
    p.add_argument("--linger", type=float, default=2.0, help="seconds to keep serving after the last step")
    p.add_argument("--json", action="store_true", help="print one JSON summary at the end")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


class JoinError(RuntimeError):
    """A problem to report in one line."""


MAX_RUN_BYTES = 1_000_000  # a run description is a few kB; more is not a collab coordinator


def fetch_run(url: str, timeout_s: float = 15.0) -> tuple[RunConfig, list[str]]:
    """The run config and DHT addresses from a coordinator; raises :class:`JoinError` (one line) for a
    malformed URL, an unreachable host, an HTTP error, and an answer that is not a run description."""
    try:
        check_url(url, "--coordinator")
    except HttpError as e:
        raise JoinError(str(e)) from None
    endpoint = url.rstrip("/") + "/v1/run"
    try:
        data = request_json(endpoint, max_bytes=MAX_RUN_BYTES, what="the coordinator")
    except HttpError as e:
        if e.status is not None:
            raise JoinError(f"{e}: is {url} a collab coordinator?") from None
        if "did not answer" in str(e) or "more than" in str(e):
            raise JoinError(f"{e}: is {url} a collab coordinator? (not a run description)") from None
        raise JoinError(str(e)) from None
    if not isinstance(data, dict) or "config" not in data:
        raise JoinError(f"{endpoint} did not answer with a run description")
    try:
        cfg = parse_config(data["config"])
    except ConfigError as e:
        raise JoinError(f"the coordinator's config is invalid: {e.problems[0]}") from None
    if data.get("version") != cfg.version():
        raise JoinError(
            f"config version mismatch: the coordinator announces {data.get('version')!r:.40}, the config "
            f"it sent is {cfg.version()} (different collab versions?)"
        )
    peers = data.get("initial_peers") or []
    if not isinstance(peers, list) or not all(isinstance(p, str) and len(p) < 1000 for p in peers):
        raise JoinError(f"{endpoint} did not answer with a run description (bad initial_peers)")
    return cfg, list(peers)


def resolve_run(args: argparse.Namespace) -> tuple[RunConfig, list[str]] | int:
    """The run config and DHT addresses from ``--coordinator`` or ``--config`` plus ``--initial-peers``;
    an exit code (after printing one line per problem) when that fails."""
    try:
        if args.coordinator:
            cfg, peers = fetch_run(args.coordinator)
        else:
            loaded = load_config_or_exit(args.config)
            if loaded is None:
                return EXIT_BAD_INPUT
            cfg, peers = loaded, []
    except JoinError as e:
        print(str(e), file=sys.stderr)
        return 1
    return cfg, [*peers, *args.initial_peers]


def pick_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise JoinError("--device cuda: no CUDA device is available here")
    return choice


def run(args: argparse.Namespace) -> int:
    if args.checkpoint_every < 1:
        print("--checkpoint-every: must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.batch_size is not None and not 1 <= args.batch_size <= 65536:
        print("--batch-size: must be between 1 and 65536", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not 0 < args.throttle <= 1:
        print("--throttle: must be a fraction in (0, 1], e.g. 0.5 for half of this machine", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.resume and not args.checkpoint:
        print("--resume: needs --checkpoint PATH (the file to resume from)", file=sys.stderr)
        return EXIT_BAD_INPUT
    resolved = resolve_run(args)
    if isinstance(resolved, int):
        return resolved
    cfg, initial_peers = resolved
    try:
        device = pick_device(args.device)
        problem = task_problem(cfg)
        if problem is not None:
            print(problem, file=sys.stderr)
            return EXIT_BAD_INPUT
    except JoinError as e:
        print(str(e), file=sys.stderr)
        return 1
    return _train(args, cfg, initial_peers, device)


def _train(args: argparse.Namespace, cfg: RunConfig, initial_peers: list[str], device: str) -> int:
    from collab.swarm import SwarmNode, Volunteer
    from collab.swarm.records import make_validators
    from collab.swarm.volunteer import ConfigMismatch
    from collab.tasks.torch_task import FactoryError
    from peers.access_client import AccessError, obtain_access

    validators, signer = make_validators(cfg.run_id)
    try:
        access = obtain_access(args, cfg, args.name or "volunteer")
    except AccessError as e:
        print(str(e), file=sys.stderr)
        return 1
    try:
        node = SwarmNode(
            initial_peers=initial_peers,
            host=args.host,
            port=args.port,
            client_mode=args.client_mode,
            auto_relay=args.auto_relay,
            max_message_bytes=cfg.swarm.max_message_bytes,
            record_validators=validators,
            access=access,
        )
    except Exception as e:  # hivemind reports unreachable peers and bad addresses in several ways
        print(f"cannot join the swarm: {e}", file=sys.stderr)
        return 1
    volunteer = None
    bar = None
    try:
        index = args.device_index
        if index is None:
            index = zlib.crc32(node.peer_key.encode()) % cfg.num_devices
        if not 0 <= index < cfg.num_devices:
            print(f"--device-index: must be in [0, {cfg.num_devices})", file=sys.stderr)
            return EXIT_BAD_INPUT
        try:
            volunteer = Volunteer(
                cfg,
                node,
                device_index=index,
                log_path=args.log_file,
                name=args.name,
                signer=signer,
                checkpoint_path=Path(args.checkpoint) if args.checkpoint else None,
                checkpoint_every=args.checkpoint_every,
                device=device,
                precision=args.precision,
                batch_size=args.batch_size,
                throttle=args.throttle,
            )
        except FactoryError as e:  # e.g. options the installed factory does not accept
            print(str(e), file=sys.stderr)
            return EXIT_BAD_INPUT
        if args.resume:
            _resume(volunteer, args.checkpoint)
        stop = volunteer.stop_event

        def on_signal(signum: int, frame: Any) -> None:
            logger.warning("signal %d: leaving after the current round", signum)
            stop.set()

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        target = args.max_steps if args.max_steps is not None else cfg.max_steps
        where = " ".join(node.visible_maddrs())
        print(
            f"{volunteer.name}: peer {node.peer_key}, shard {index}, run {cfg.run_id}, at {where}",
            file=sys.stderr,
        )
        if not args.no_progress and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=target, desc=volunteer.name, unit="step", file=sys.stderr)
            volunteer.on_step = lambda rec: _update_bar(bar, rec)
        try:
            last = volunteer.run(max_steps=target)
        except ConfigMismatch as e:
            print(str(e), file=sys.stderr)
            return EXIT_BAD_INPUT
        summary = {
            "peer": node.peer_key,
            "name": volunteer.name,
            "device_index": index,
            "step": last,
            "hash": volunteer.method.state.hash() if volunteer.method.state else None,
            "metric": volunteer.task.metric(volunteer.method.z) if volunteer.method.state else None,
            "bits_up": volunteer.aggregator.stats.bits_up,
            "bits_down": volunteer.aggregator.stats.bits_down,
            "wire_bytes_sent": volunteer.aggregator.stats.wire_bytes_sent,
            "wire_bytes_received": volunteer.aggregator.stats.wire_bytes_received,
        }
        if args.json:
            print(json.dumps(summary), flush=True)
        return 0 if last >= target or stop.is_set() else 1
    finally:
        if bar is not None:
            bar.close()
        if volunteer is not None:
            volunteer.close(linger_s=args.linger)
        node.shutdown()


def _resume(volunteer: Any, path: str) -> None:
    """Load the local checkpoint; one line on stderr says what happened (a bad one is skipped: the
    volunteer then starts like a new peer and syncs from the swarm)."""
    from collab.methods.checkpoint import CheckpointError

    try:
        loaded = volunteer.load_checkpoint(path)
    except CheckpointError as e:
        print(str(e), file=sys.stderr)
        return
    if loaded:
        print(f"resumed from checkpoint {path} at step {volunteer.step}", file=sys.stderr)
    else:
        print(f"checkpoint {path} does not exist yet: starting fresh", file=sys.stderr)


def _update_bar(bar: Any, rec: dict[str, Any]) -> None:
    bar.n = rec["step"]
    bar.set_postfix(
        metric=f"{rec['metric']:.2e}",
        peers=rec["group"],
        samples_s=f"{rec.get('samples_per_s', 0.0):.1f}",
        kbit=f"{rec['bits_up'] / 1e3:.0f}",
        MB=f"{(rec['wire_sent'] + rec['wire_received']) / 1e6:.2f}",
        refresh=False,
    )
    bar.refresh()


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["join", *sys.argv[1:]]))
