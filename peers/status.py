"""Print the run's summary in the terminal (the same figures the dashboard shows)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--coordinator", metavar="URL", help="the run's config server (its dashboard is used)")
    src.add_argument("--monitor", metavar="URL", help="a dashboard URL, e.g. http://HOST:8080")
    p.add_argument("--json", action="store_true", help="print the raw summary JSON")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read(1_000_000))


def run(args: argparse.Namespace) -> int:
    try:
        base = args.monitor
        if args.coordinator:
            base = _get(args.coordinator.rstrip("/") + "/v1/run").get("dashboard")
            if not base:
                print("this coordinator runs no dashboard (start it with --dashboard-port)", file=sys.stderr)
                return 1
        s = _get(base.rstrip("/") + "/api/summary")
    except (urllib.error.URLError, OSError, json.JSONDecodeError, AttributeError) as e:
        print(f"cannot read the run's summary: {getattr(e, 'reason', e)}", file=sys.stderr)
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
