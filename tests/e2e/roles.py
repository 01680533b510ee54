"""Helpers to run the roles as a person would: separate `collab` commands, each in its own process group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import COLLAB
from tests.integration.swarm_harness import group_alive, owned, p2pd_pids


class Roles:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str, name: str, stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*COLLAB, *args],
            stdout=stdout,
            stderr=(self.tmp / f"{name}.err").open("w"),
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def read_line(self, proc: subprocess.Popen[str], prefix: str, timeout_s: float = 60.0) -> str:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            if not line and proc.poll() is not None:
                break
        raise AssertionError(f"no line starting with {prefix!r}")

    def kill(self, proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
        """SIGKILL: the whole process group (a machine going away); other signals: the command itself,
        as `kill PID` would."""
        with contextlib.suppress(ProcessLookupError):
            if sig == signal.SIGKILL:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        proc.wait(timeout=60)

    def summary(self, proc: subprocess.Popen[str], timeout_s: float, name: str) -> dict[str, Any]:
        out, _ = proc.communicate(timeout=timeout_s)
        err = (self.tmp / f"{name}.err").read_text()[-3000:]
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{err}"
        return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def roles(tmp_path: Path) -> Iterator[Roles]:
    """Start role processes; at teardown kill every process group by PID and check no p2pd is left."""
    before = p2pd_pids()
    r = Roles(tmp_path)
    try:
        yield r
    finally:
        for proc in r.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        sessions = {p.pid for p in r.procs}  # each role leads its own session; other test runs are not ours
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            owned(p2pd_pids() - before, sessions) or any(group_alive(p.pid) for p in r.procs)
        ):
            time.sleep(0.1)
        left = owned(p2pd_pids() - before, sessions)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not left, f"p2pd processes left behind: {sorted(left)}"
