"""Shared test fixtures: repository paths and a reaper for child processes started by a test."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


def _collab_command() -> list[str]:
    """The installed `collab` console script of this interpreter (what a user types), found next to the
    interpreter first so a stale PATH or shim cannot pick another installation."""
    beside = Path(sys.executable).parent / "collab"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("collab")
    return [found] if found else [sys.executable, "-m", "peers"]


COLLAB = _collab_command()


# torch starts one shared-memory manager per process on first use of torch.multiprocessing (hivemind's
# DHT does); it lives as long as the test process by design.
_LONG_LIVED = {"torch_shm_manag"}


def _children(pid: int) -> set[int]:
    """All descendant PIDs of ``pid`` (from /proc, no extra dependency), except torch's shm manager."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if (entry / "comm").read_text().strip() in _LONG_LIVED:
                continue
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(entry.name))
    out: set[int] = set()
    stack = [pid]
    while stack:
        for child in kids.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


@pytest.fixture(autouse=True)
def reap_children() -> Iterator[None]:
    """Kill (by PID) any process a test left behind, and fail that test: every test cleans up after itself."""
    before = _children(os.getpid())
    yield
    leftover = _children(os.getpid()) - before
    for pid in leftover:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in leftover:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    assert not leftover, f"test left child processes behind: {sorted(leftover)}"


def run_cli(*args: str, timeout: float = 120.0, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``collab ARGS`` as a user would (a separate process), with a timeout."""
    return subprocess.run(
        [*COLLAB, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO, check=False
    )
