"""Helpers shared by the entry points: config loading with one-line errors, exit codes."""

from __future__ import annotations

import sys

from collab.config import ConfigError, RunConfig, load_config

EXIT_BAD_INPUT = 2


def load_config_or_exit(path: str) -> RunConfig | None:
    """The config at ``path``, or ``None`` after printing one line per problem to stderr."""
    try:
        return load_config(path)
    except ConfigError as e:
        for line in e.problems:
            print(f"{path}: {line}" if not line.startswith(path) else line, file=sys.stderr)
        return None
