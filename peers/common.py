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


def task_problem(cfg: RunConfig) -> str | None:
    """One line saying why this machine cannot build ``cfg``'s task (its factory is not installed, not a
    task factory...), or ``None``. Only PyTorch tasks name code; importing it loads torch."""
    if cfg.task.name == "text2image":
        from collab.tasks.scenes import CaptionError, parse_caption

        for i, prompt in enumerate(cfg.task.prompts):
            try:
                parse_caption(prompt)
            except CaptionError as e:
                return f"task.prompts.{i}: {e}"
        return None
    if cfg.task.name != "torch":
        return None
    from collab.tasks.torch_task import FactoryError, load_factory

    try:
        load_factory(cfg.task.factory)
    except FactoryError as e:
        return str(e)
    return None
