"""``collab``: one console script, one subcommand per role or tool.

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int`` and also
runs as ``python -m peers.<name>``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from collab import __version__
from peers import (
    coordinator,
    demo,
    export,
    generate,
    join,
    keeper,
    monitor_peer,
    simulate,
    status,
    validate,
)

SUBCOMMANDS = {
    "validate": validate,
    "simulate": simulate,
    "coordinator": coordinator,
    "join": join,
    "demo": demo,
    "monitor": monitor_peer,
    "status": status,
    "export": export,
    "generate": generate,
    "keeper": keeper,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collab",
        description="collab: collaborative training over the Internet with compressed communication (MASHA).",
    )
    parser.add_argument("--version", action="version", version=f"collab {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        doc = (module.__doc__ or "").strip().splitlines()[0]
        p = sub.add_parser(
            name, help=doc, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
