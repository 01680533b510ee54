"""A volunteer's own checkpoints: the committed state on disk, so a killed peer resumes where it was."""

from __future__ import annotations

import logging
from pathlib import Path

from collab.config import RunConfig
from collab.methods.base import Method, MethodState
from collab.methods.checkpoint import CheckpointError, encode_checkpoint, read_checkpoint, write_checkpoint

logger = logging.getLogger(__name__)


class Checkpointer:
    """Writes ``method``'s committed state to ``path`` every ``every`` steps (0: only when asked, e.g. on
    exit) and reads it back. The file names the config version and method and carries the run config, so
    ``collab export`` needs nothing else (collab/methods/checkpoint.py)."""

    def __init__(self, *, path: str | Path | None, every: int, cfg: RunConfig, method: Method) -> None:
        self.path = Path(path) if path else None
        self.every, self.cfg, self.method = every, cfg, method
        self.config_version = cfg.version()

    def after_step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            self.save()

    def save(self) -> None:
        """Atomically (temp file, fsync, rename): a crash never leaves half a file."""
        if self.path is None or self.method.state is None:
            return
        data = encode_checkpoint(
            self.method.state, config_version=self.config_version, method=self.method.name, config=self.cfg
        )
        write_checkpoint(self.path, data)

    def load(self, path: str | Path) -> MethodState | None:
        """Adopt the checkpoint at ``path``; ``None`` if there is none. Raises :class:`CheckpointError`
        (one line: corrupt, truncated, another config or method) and then loads nothing."""
        state = read_checkpoint(path, config_version=self.config_version, method=self.method.name)
        if state is None:
            return None
        try:
            self.method.adopt_state(state)
        except ValueError as e:  # same config version, other shapes: only a changed task could do this
            raise CheckpointError(f"checkpoint {path} does not fit this run ({e}); not loaded") from None
        return state
