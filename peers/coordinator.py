"""Run a training run's coordinator: the DHT bootstrap peer and the config server volunteers join through.

Validates the config first (one line per problem, exit 2, nothing started). The DHT peer keeps its
identity in --identity, so with a fixed --dht-port its address survives restarts; the config server
serves the same config (same version) after a restart. Prints the exact join command for volunteers.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from pathlib import Path

from peers.common import EXIT_BAD_INPUT, load_config_or_exit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config")
    p.add_argument(
        "--host", default="127.0.0.1", help="address of the config server and DHT (default 127.0.0.1)"
    )
    p.add_argument("--port", type=int, default=8000, help="config server port (0: any free port)")
    p.add_argument("--dht-port", type=int, default=0, help="DHT port (0: any free port)")
    p.add_argument("--identity", help="file with the DHT peer's private key (created if missing)")
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="join this DHT instead")
    p.add_argument(
        "--dashboard-port", type=int, help="also run the monitor and its dashboard on this port (0: any)"
    )
    p.add_argument("--db", default="runs/monitor.sqlite", help="the embedded monitor's SQLite history")
    p.add_argument(
        "--keep-model",
        metavar="DIR",
        help="also run the model keeper (collab keeper): versioned checkpoints in DIR and, for text2image "
        "runs, a sample gallery on the dashboard",
    )
    p.add_argument(
        "--keep-every",
        type=int,
        metavar="N",
        help="steps between kept checkpoints (default: a tenth of the run)",
    )
    p.add_argument(
        "--authority-key",
        help="invite-only runs: file with the key that signs access tokens "
        "(default runs/RUN_ID/authority.key, created if missing)",
    )
    p.add_argument(
        "--invite",
        help="invite-only runs: the invite volunteers pass as --token (default: read from or created in "
        "runs/RUN_ID/invite.txt)",
    )


def run(args: argparse.Namespace) -> int:
    cfg = load_config_or_exit(args.config)
    if cfg is None:
        return EXIT_BAD_INPUT
    if args.keep_every is not None and args.keep_every < 1:
        print("--keep-every: must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    from collab.swarm import SwarmNode
    from collab.swarm.records import make_validators
    from peers.config_server import bind, build_app, serve

    try:
        sock = bind(args.host, args.port)
        dash_sock = bind(args.host, args.dashboard_port) if args.dashboard_port is not None else None
    except OSError as e:
        print(f"--port/--dashboard-port: cannot listen on {args.host}: {e.strerror}", file=sys.stderr)
        return 1
    validators, _ = make_validators(cfg.run_id)
    issuer = None
    if cfg.access == "invite":
        from collab.swarm.access import Access, AccessDenied, TokenIssuer, load_or_create_key

        try:
            authority = load_or_create_key(args.authority_key or f"runs/{cfg.run_id}/authority.key")
            invite = args.invite or _load_or_create_invite(Path(f"runs/{cfg.run_id}/invite.txt"))
        except (OSError, AccessDenied) as e:
            print(f"--authority-key/--invite: {e}", file=sys.stderr)
            sock.close()
            return 1
        issuer = TokenIssuer(authority, invite=invite, ttl_s=cfg.access_token_ttl_s)
    try:
        node = SwarmNode(
            initial_peers=args.initial_peers,
            host=args.host,
            port=args.dht_port,
            identity_path=args.identity,
            record_validators=validators,
            access=Access(issuer.credentials()) if issuer is not None else None,
        )
    except Exception as e:  # hivemind reports bad addresses and unreachable peers in several ways
        print(f"cannot start the DHT peer: {e}", file=sys.stderr)
        sock.close()
        return 1
    from collab.swarm.volunteer import CoordinatorBeacon

    beacon = CoordinatorBeacon(cfg, node)
    monitor, dashboard_server, dashboard, keeper = None, None, None, None
    try:
        url = f"http://{args.host}:{sock.getsockname()[1]}"
        join_command = f"collab join --coordinator {url}" + (
            f" --token {issuer.invite}" if issuer is not None else ""
        )
        print(f"collab coordinator: run {cfg.run_id}, config version {cfg.version()}", flush=True)
        print(f"config server: {url}", flush=True)
        print(f"DHT: {' '.join(node.visible_maddrs())}", flush=True)
        if dash_sock is not None:
            from monitor.app import build_app as build_dashboard
            from monitor.service import Monitor
            from monitor.store import MonitorStore
            from peers.config_server import serve_in_thread

            monitor = Monitor(cfg, node, MonitorStore(args.db)).start()
            gallery = Path(args.keep_model) / "gallery" if args.keep_model else None
            app = build_dashboard(monitor, gallery_dir=gallery, join_command=join_command)
            dashboard_server, _ = serve_in_thread(app, dash_sock)
            dashboard = f"http://{args.host}:{dash_sock.getsockname()[1]}/"
            print(f"dashboard: {dashboard}", flush=True)
        print(f"volunteers join with: {join_command}", flush=True)
        if args.keep_model:
            keeper = _start_keeper(args, url, issuer.invite if issuer is not None else None)
            print(f"model keeper: checkpoints in {args.keep_model} (log: {args.keep_model}/keeper.log)")
        serve(build_app(cfg, node.visible_maddrs, dashboard, issuer), sock)
    finally:
        if keeper is not None:
            _stop_keeper(keeper)
        if dashboard_server is not None:
            dashboard_server.should_exit = True
        if monitor is not None:
            monitor.stop()
            monitor.store.close()
        beacon.close()
        node.shutdown()
    return 0


def _start_keeper(args: argparse.Namespace, url: str, invite: str | None) -> subprocess.Popen[bytes]:
    """``collab keeper`` in its own process (its CPU use is niced there), fetching the run from this
    coordinator: the config server's socket is already listening, so its first request waits, not fails.
    It stays in the coordinator's process group: whatever stops the coordinator's group stops it too."""
    folder = Path(args.keep_model)
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "peers", "keeper", "--coordinator", url, "--out", str(folder)]
    cmd += ["--every", str(args.keep_every)] if args.keep_every else []
    cmd += ["--token", invite] if invite else []
    with (folder / "keeper.log").open("ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _stop_keeper(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (it leaves at once, shutting down its DHT node), SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _load_or_create_invite(path: Path) -> str:
    """The invite in ``path``, or a new random one written there (mode 0600, atomically)."""
    if path.exists():
        invite = path.read_text().strip()
        if invite:
            return invite
    import secrets

    from collab.files import atomic_write

    invite = secrets.token_urlsafe(18)
    atomic_write(path, (invite + "\n").encode(), mode=0o600)
    return invite


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["coordinator", *sys.argv[1:]]))
