"""Writing files so that a crash never leaves half of one: temp file, fsync, rename, fsync of the folder.

Used for every file collab keeps across restarts: checkpoints, the coordinator's authority key and invite.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def atomic_write(path: str | Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically; the file gets permission bits ``mode`` (e.g. 0o600 for
    secrets) from the moment it exists."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be opened for fsync
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
