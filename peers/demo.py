"""A whole swarm on this machine: a coordinator plus N volunteers as separate processes on 127.0.0.1.

Each volunteer is a real `collab join --coordinator URL` process with its own DHT node and p2pd. The run
uses the config with num_devices = --peers (one data shard per volunteer) and every volunteer in every
round, so its result equals `collab simulate` of the same settings (for neural-network tasks: when
every process uses the same number of torch threads, since CPU float sums depend on it). Ends with
a summary table; with --json, one JSON object (run_id, peers, steps, final_metric, state_hashes,
bits_per_peer, wire_bytes_per_peer).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from collab.config import ConfigError, with_overrides
from collab.swarm.timing import Timing
from peers.common import EXIT_BAD_INPUT, load_config_or_exit, task_problem

# The repository's configs/ (an editable install); elsewhere (e.g. the Docker image) ./configs.
_REPO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
DEFAULT_CONFIG = _REPO_CONFIG if _REPO_CONFIG.exists() else Path("configs") / "demo.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=4, help="number of volunteers (default 4)")
    p.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="YAML run config (default configs/demo.yaml)"
    )
    p.add_argument("--max-steps", type=int, help="steps to run (default: the config's max_steps)")
    p.add_argument(
        "--workdir", help="folder for the run's config, logs and checkpoints (default: a new temp dir)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="give up after this many seconds in all (default: no limit; the demo still gives up when no "
        "volunteer finishes a step for 10 rounds' worth of the config's matchmaking and all-reduce timeouts)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per volunteer (default: the machine's cores divided among the volunteers, at "
        "least 1, unless OMP_NUM_THREADS is set; a simulation equals the run when it uses the same count)",
    )
    p.add_argument("--plot", metavar="PNG", help="plot the metric against the step to this file")
    p.add_argument("--json", action="store_true", help="end with one JSON object")


def _volunteer_env(threads: int | None, peers: int) -> dict[str, str]:
    """The volunteers' environment: the machine's cores shared among them (N volunteers with all cores
    each would oversubscribe the CPU), unless --threads or OMP_NUM_THREADS says otherwise."""
    env = dict(os.environ)
    if threads is None and "OMP_NUM_THREADS" in env:
        return env
    count = threads if threads is not None else max(1, (os.cpu_count() or 1) // peers)
    env["OMP_NUM_THREADS"] = str(count)
    return env


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "peers", *args]


def _stop(procs: list[subprocess.Popen[Any]], sig: int = signal.SIGTERM, wait_s: float = 20.0) -> None:
    """Stop children: ``sig`` to each child itself, all at once, then SIGKILL to the whole process group
    of any still there after ``wait_s`` (one wait for all: a volunteer told to leave finishes its round,
    whose other members are leaving too). Only the child itself is signalled at first: it stops its own
    DHT process and p2pd daemon when it leaves, and a daemon killed under it turned that round and every
    DHT write after it into timeouts (measured: 32 s from Ctrl-C to the demo's exit)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
    deadline = time.monotonic() + wait_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM (``kill``, a service manager, ``timeout``) stops the demo as Ctrl-C does: its coordinator
    and volunteers, each in a session of its own, would otherwise outlive it."""
    raise KeyboardInterrupt("terminated")


def _read_url(proc: subprocess.Popen[str], timeout_s: float) -> tuple[str, str]:
    """The config server and dashboard URLs the coordinator prints on start."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited with code {proc.returncode}")
            continue
        if line.startswith("config server: "):
            url = line.split(": ", 1)[1].strip()
        if line.startswith("dashboard: ") and url:
            return url, line.split(": ", 1)[1].strip()
    raise RuntimeError("the coordinator did not start in time")


def _last_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def run(args: argparse.Namespace) -> int:
    if args.peers < 1:
        print("--peers: must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.threads is not None and args.threads < 1:
        print("--threads: must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    volunteer_env = _volunteer_env(args.threads, args.peers)
    cfg = load_config_or_exit(args.config)
    if cfg is None:
        return EXIT_BAD_INPUT
    try:
        cfg = with_overrides(
            cfg,
            num_devices=args.peers,
            max_steps=args.max_steps if args.max_steps is not None else cfg.max_steps,
            swarm={"min_group_size": args.peers},
        )
    except ConfigError as e:
        for line in e.problems:
            print(f"demo settings: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    problem = task_problem(cfg)
    if problem is not None:
        print(f"{args.config}: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    work = Path(args.workdir or tempfile.mkdtemp(prefix="collab-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    config_path = work / "run.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))

    procs: list[subprocess.Popen[Any]] = []
    signal.signal(signal.SIGTERM, _terminated)
    access: list[str] = []  # an invite-only config: the demo is its own organizer and hands out the invite
    if cfg.access == "invite":
        import secrets

        invite = secrets.token_urlsafe(12)
        access = ["--authority-key", str(work / "authority.key"), "--invite", invite]
    coord = subprocess.Popen(
        _cmd(
            "coordinator",
            "--config",
            str(config_path),
            "--port",
            "0",
            "--identity",
            str(work / "coordinator.key"),
            "--dashboard-port",
            "0",
            "--db",
            str(work / "monitor.sqlite"),
            "--keep-model",
            str(work / "model"),
            *access,
        ),
        stdout=subprocess.PIPE,
        stderr=(work / "coordinator.err").open("w"),
        text=True,
        start_new_session=True,
    )
    try:
        url, dashboard = _read_url(coord, 120.0)
        print(f"coordinator at {url}; starting {args.peers} volunteers (logs in {work})", file=sys.stderr)
        print(f"dashboard: {dashboard}   (collab status --coordinator {url})", file=sys.stderr, flush=True)
        for i in range(args.peers):
            procs.append(
                subprocess.Popen(
                    _cmd(
                        "join",
                        "--coordinator",
                        url,
                        "--device-index",
                        str(i),
                        "--name",
                        f"volunteer-{i}",
                        "--log-file",
                        str(work / f"volunteer-{i}.jsonl"),
                        "--checkpoint",
                        str(work / f"volunteer-{i}.state"),
                        "--json",
                        "--no-progress",
                        "--linger",
                        "3",
                        *(["--token", access[-1]] if access else []),
                    ),
                    stdout=subprocess.PIPE,
                    stderr=(work / f"volunteer-{i}.err").open("w"),
                    text=True,
                    env=volunteer_env,
                    start_new_session=True,
                )
            )
        stall_s = STARTUP_S + Timing.of(cfg.swarm).stall_s
        summaries = _wait(procs, work, cfg.max_steps, args.timeout, stall_s)
        kept = _wait_for_keeper(work / "model", cfg.max_steps, stall_s)
    except (RuntimeError, KeyboardInterrupt) as e:
        print(f"demo stopped: {str(e) or 'interrupted'} (logs in {work})", file=sys.stderr)
        return 1
    finally:
        _stop(procs)
        _stop([coord])

    logs = [_last_lines(work / f"volunteer-{i}.jsonl") for i in range(args.peers)]
    per_step = [{r["step"]: r for r in lines if "event" not in r} for lines in logs]
    common = min((max(s) for s in per_step if s), default=0)
    hashes = {
        s["name"]: per_step[i][common]["hash"] for i, s in enumerate(summaries) if common in per_step[i]
    }
    final_metric = summaries[0]["metric"] if summaries else None
    result = {
        "run_id": cfg.run_id,
        "config_version": cfg.version(),
        "peers": args.peers,
        "steps": common,
        "final_metric": final_metric,
        "metric_name": "rel_distance" if cfg.task.name == "bilinear" else "loss",
        "state_hashes": hashes,
        "bits_per_peer": {s["name"]: s["bits_up"] for s in summaries},
        "bits_down_per_peer": {s["name"]: s["bits_down"] for s in summaries},
        "wire_bytes_per_peer": {
            s["name"]: s["wire_bytes_sent"] + s["wire_bytes_received"] for s in summaries
        },
        "workdir": str(work),
        "dashboard": dashboard,
        "kept_steps": kept,
    }
    print(_table(result, summaries))
    if kept:
        print(f"model kept by the coordinator at steps {kept} in {work / 'model'}")
    if args.plot and per_step and per_step[0]:
        _plot(args.plot, per_step[0], result["metric_name"], f"{cfg.run_id}: {args.peers} volunteers")
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps(result))
    ok = len(summaries) == args.peers and len(set(hashes.values())) == 1 and common == cfg.max_steps
    return 0 if ok else 1


STARTUP_S = 120.0  # starting the processes, their DHT nodes and the first state, on a busy machine


def _wait(
    procs: list[subprocess.Popen[Any]], work: Path, steps: int, timeout_s: float | None, stall_s: float
) -> list[dict[str, Any]]:
    """Wait for the volunteers; give up after ``timeout_s`` in all (if set) or when the slowest volunteer's
    step has not moved for ``stall_s`` (progress, not a guess at the run's length)."""
    start = time.monotonic()
    last_report, progress, moved = 0.0, -1, start
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if timeout_s is not None and now - start > timeout_s:
            raise RuntimeError(f"the run did not finish within {timeout_s:.0f}s")
        if now - moved > stall_s:
            raise RuntimeError(
                f"no step completed by every volunteer for {stall_s:.0f}s (stuck at {progress})"
            )
        if now - last_report > 5.0:
            last_report = now
            lines = [_last_lines(work / f"volunteer-{i}.jsonl") for i in range(len(procs))]
            done = [max((r["step"] for r in ls if "event" not in r), default=0) for ls in lines]
            if min(done) > progress:
                progress, moved = min(done), now
            metric = next((r["metric"] for r in reversed(lines[0]) if "metric" in r), None)
            shown = f", metric {metric:.3e}" if metric is not None else ""
            print(f"  step {min(done)}/{steps}{shown}", file=sys.stderr)
        time.sleep(0.2)
    summaries = []
    for i, p in enumerate(procs):
        out = p.stdout.read() if p.stdout else ""
        if p.returncode != 0:
            raise RuntimeError(f"volunteer {i} exited with code {p.returncode} (see volunteer-{i}.err)")
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    return summaries


def _wait_for_keeper(folder: Path, last_step: int, patience_s: float) -> list[int]:
    """The steps the coordinator's model keeper kept, once it has kept the last one (and drawn its gallery,
    if the run has one), or after ``patience_s`` without a new checkpoint."""
    from collab import gallery
    from collab.swarm.keeper import kept_steps

    moved, seen = time.monotonic(), kept_steps(folder)
    has_gallery = (folder / "gallery").exists()
    while time.monotonic() - moved < patience_s:
        if seen and seen[-1] >= last_step:
            entries = gallery.read_index(folder / "gallery").entries
            if not has_gallery or (entries and entries[-1].step >= last_step):
                break
        time.sleep(0.2)
        now = kept_steps(folder)
        if now != seen:
            seen, moved = now, time.monotonic()
    return seen


def _plot(path: str, records: dict[int, dict[str, Any]], metric_name: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [records[s]["metric"] for s in steps])
    if metric_name == "rel_distance":
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(metric_name)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(result: dict[str, Any], summaries: list[dict[str, Any]]) -> str:
    lines = [
        f"run {result['run_id']}: {result['peers']} volunteers, {result['steps']} steps, "
        f"final {result['metric_name']} {result['final_metric']:.3e}",
        f"{'volunteer':<14}{'shard':>6}{'state hash':>36}{'kbit sent':>12}{'wire MB':>10}",
    ]
    for s in summaries:
        wire = (s["wire_bytes_sent"] + s["wire_bytes_received"]) / 1e6
        lines.append(
            f"{s['name']:<14}{s['device_index']:>6}{s['hash']:>36}{s['bits_up'] / 1e3:>12.1f}{wire:>10.3f}"
        )
    same = len(set(result["state_hashes"].values())) == 1
    lines.append("all volunteers hold the same state" if same else "STATE HASHES DIFFER")
    return "\n".join(lines)


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
