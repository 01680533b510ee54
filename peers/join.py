"""Join a training run as a volunteer: sync state from the swarm and train your shard.

Until the coordinator exists, the run config comes from a file (--config) and the swarm from
--initial-peers (the multiaddress of any peer of the run's DHT). Ctrl-C leaves cleanly: the current
round is finished or abandoned as a whole, never half applied.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import zlib
from typing import Any

from peers.common import EXIT_BAD_INPUT, load_config_or_exit

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config (the same file on every peer)")
    p.add_argument(
        "--initial-peers", nargs="+", default=[], metavar="MADDR", help="multiaddrs of peers to join"
    )
    p.add_argument(
        "--device-index", type=int, help="which data shard this peer trains (default: from its key)"
    )
    p.add_argument("--max-steps", type=int, help="stop after this step (default: the config's max_steps)")
    p.add_argument("--name", help="display name")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="TCP port to listen on (default: any free port)")
    p.add_argument("--client-mode", action="store_true", help="behind NAT: connect out only, accept no calls")
    p.add_argument("--log-file", help="append one JSON object per step/event to this file")
    p.add_argument("--linger", type=float, default=2.0, help="seconds to keep serving after the last step")
    p.add_argument("--json", action="store_true", help="print one JSON summary at the end")


def run(args: argparse.Namespace) -> int:
    cfg = load_config_or_exit(args.config)
    if cfg is None:
        return EXIT_BAD_INPUT
    from collab.swarm import SwarmNode, Volunteer

    try:
        node = SwarmNode(
            initial_peers=args.initial_peers,
            host=args.host,
            port=args.port,
            client_mode=args.client_mode,
            max_message_bytes=cfg.swarm.max_message_bytes,
        )
    except Exception as e:  # hivemind reports unreachable peers and bad addresses in several ways
        print(f"cannot join the swarm: {e}", file=sys.stderr)
        return 1
    volunteer = None
    try:
        device = args.device_index
        if device is None:
            device = zlib.crc32(node.peer_key.encode()) % cfg.num_devices
        if not 0 <= device < cfg.num_devices:
            print(f"--device-index: must be in [0, {cfg.num_devices})", file=sys.stderr)
            return EXIT_BAD_INPUT
        volunteer = Volunteer(cfg, node, device_index=device, log_path=args.log_file, name=args.name)
        stop = volunteer.stop_event

        def on_signal(signum: int, frame: Any) -> None:
            logger.warning("signal %d: leaving after the current round", signum)
            stop.set()

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        print(
            f"peer {node.peer_key} device {device} listening on {' '.join(node.visible_maddrs())}",
            file=sys.stderr,
        )
        last = volunteer.run(max_steps=args.max_steps)
        summary = {
            "peer": node.peer_key,
            "device": device,
            "step": last,
            "hash": volunteer.method.state.hash() if volunteer.method.state else None,
            "metric": volunteer.task.metric(volunteer.method.z) if volunteer.method.state else None,
            "bits_up": volunteer.aggregator.stats.bits_up,
            "bits_down": volunteer.aggregator.stats.bits_down,
            "wire_bytes_sent": volunteer.aggregator.stats.wire_bytes_sent,
            "wire_bytes_received": volunteer.aggregator.stats.wire_bytes_received,
        }
        if args.json:
            print(json.dumps(summary))
        target = args.max_steps if args.max_steps is not None else cfg.max_steps
        return 0 if last >= target or stop.is_set() else 1
    finally:
        if volunteer is not None:
            volunteer.close(linger_s=args.linger)
        node.shutdown()


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["join", *sys.argv[1:]]))
