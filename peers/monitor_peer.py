"""Watch a run: read the peers' signed progress records, keep history in SQLite, serve the dashboard.

With --coordinator the run config and DHT addresses come from the organizer's config server; with
--config and --initial-peers from a file and any peer of the run. History survives restarts (--db).
Open the printed URL in a browser; scripts can use the JSON API under /api/.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from peers.join import add_run_source_arguments

    add_run_source_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="dashboard address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="dashboard port (0: any free port)")
    p.add_argument("--db", default="runs/monitor.sqlite", help="SQLite history file")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between DHT reads")
    p.add_argument(
        "--gallery", metavar="DIR", help="show the sample gallery of a model keeper (its OUT/gallery folder)"
    )


def run(args: argparse.Namespace) -> int:
    from peers.join import resolve_run

    resolved = resolve_run(args)
    if isinstance(resolved, int):
        return resolved
    cfg, peers = resolved
    # A reader only: load hivemind's DHT without its package (and torch) to stay small; see reader.py.
    from collab.swarm.reader import DhtReader, load_dht_modules

    load_dht_modules()
    from collab.swarm.records import make_validators
    from monitor.app import build_app
    from monitor.service import Monitor
    from monitor.store import MonitorStore
    from peers.config_server import bind, serve

    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"--port: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 1
    from peers.access_client import AccessError, obtain_access

    validators, _ = make_validators(cfg.run_id)
    try:
        access = obtain_access(args, cfg, "monitor")
    except AccessError as e:
        print(str(e), file=sys.stderr)
        sock.close()
        return 1
    try:
        # In client mode the node stores and serves nothing for others.
        authorizer = access.authorizer if access is not None else None
        node = DhtReader(peers, record_validators=validators, host=args.host, authorizer=authorizer)
    except Exception as e:  # hivemind reports bad addresses and unreachable peers in several ways
        print(f"cannot join the swarm: {e}", file=sys.stderr)
        return 1
    store = MonitorStore(args.db)
    monitor = Monitor(cfg, node, store, poll_interval_s=args.poll_interval).start()
    try:
        print(f"dashboard: http://{args.host}:{sock.getsockname()[1]}/", flush=True)
        serve(build_app(monitor, gallery_dir=args.gallery, join_command=_join_command(args)), sock)
    finally:
        monitor.stop()
        store.close()
        node.shutdown()
    return 0


def _join_command(args: argparse.Namespace) -> str:
    """What a viewer runs to join the run this monitor watches."""
    if args.coordinator:
        token = f" --token {args.token}" if args.token else ""
        return f"collab join --coordinator {args.coordinator}{token}"
    return f"collab join --config {args.config} --initial-peers {' '.join(args.initial_peers)}".strip()


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["monitor", *sys.argv[1:]]))
