"""Check a run config: prints `ok` or one line per problem naming the field (exit 2).

A PyTorch task's factory must be importable here (installed by the volunteer; never fetched).
"""

from __future__ import annotations

import argparse
import sys

from peers.common import EXIT_BAD_INPUT, load_config_or_exit, task_problem


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="path of a YAML or JSON run config")


def run(args: argparse.Namespace) -> int:
    cfg = load_config_or_exit(args.config)
    if cfg is None:
        return EXIT_BAD_INPUT
    problem = task_problem(cfg)
    if problem is not None:
        print(f"{args.config}: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("ok")
    print(f"run_id={cfg.run_id} version={cfg.version()} method={cfg.method.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["validate", *sys.argv[1:]]))
