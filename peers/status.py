"""Print the run's summary in the terminal (the same figures the dashboard shows)."""

from __future__ import annotations

import argparse
import json
import sys

from peers.http_client import HttpError, check_url, request_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--coordinator", metavar="URL", help="the run's config server (its dashboard is used)")
    src.add_argument("--monitor", metavar="URL", help="a dashboard URL, e.g. http://HOST:8080")
    p.add_argument("--json", action="store_true", help="print the raw summary JSON")


def run(args: argparse.Namespace) -> int:
    try:
        base = args.monitor
        check_url(args.coordinator or base, "--coordinator" if args.coordinator else "--monitor")
        if args.coordinator:
            run_info = request_json(args.coordinator.rstrip("/") + "/v1/run", what="the coordinator")
            base = run_info.get("dashboard") if isinstance(run_info, dict) else None
            if not isinstance(base, str) or not base:
                print("this coordinator runs no dashboard (start it with --dashboard-port)", file=sys.stderr)
                return 1
        s = request_json(base.rstrip("/") + "/api/summary", what="the dashboard")
        if not isinstance(s, dict):
            raise HttpError(f"{base} did not answer with a run summary")
    except HttpError as e:
        print(f"cannot read the run's summary: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(s))
        return 0
    metric = "-" if s.get("metric") is None else f"{s['metric']:.4g}"
    ratio = "-" if s.get("compression_ratio") is None else f"{s['compression_ratio']:.2f}x"
    print(f"run {s.get('run_id')} (config {s.get('config_version')})")
    rate = s.get("samples_per_s", 0)
    print(f"  step {s.get('global_step')}   alive peers {s.get('alive_peers')}   samples/s {rate:.1f}")
    print(f"  {s.get('metric_name') or 'metric'} {metric}   compression vs dense {ratio}")
    print(
        f"  per peer: {s.get('bits_up', 0) / 8e6:.3f} MB sent (algorithmic), "
        f"{(s.get('wire_sent', 0) + s.get('wire_received', 0)) / 1e6:.3f} MB on the wire"
    )
    print(f"  rejected records: {s.get('rejected_records', 0)}")
    return 0


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["status", *sys.argv[1:]]))
