"""Start real peers (`collab join` processes, each with its own DHT and p2pd) on 127.0.0.1 and watch them.

Each peer runs in its own process group so that a test can kill it whole (SIGKILL to the group: the peer,
its DHT process and its p2pd, like a machine going down) and so that teardown can reap everything by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
import pytest
import yaml

from collab.swarm.transport import SwarmNode
from tests.conftest import COLLAB, _children


def p2pd_pids() -> set[int]:
    """PIDs of every running p2pd daemon on this machine."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "p2pd":
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def owned(pids: set[int], sessions: set[int]) -> set[int]:
    """The daemons among ``pids`` that this test started: in one of its peers' sessions, or below this
    process (the bootstrap DHT's). Other test runs on the machine have their own, which are not ours to reap.
    """
    below = _children(os.getpid())
    out = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if pid in below or os.getsid(pid) in sessions:
                out.add(pid)
    return out


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@dataclass
class Peer:
    index: int
    proc: subprocess.Popen[str]
    log: Path
    err: Path

    def records(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written
        return out

    def steps(self) -> dict[int, str]:
        """step -> state hash, from the per-step lines (the last one wins after a sync)."""
        return {r["step"]: r["hash"] for r in self.records() if "event" not in r}

    def last_step(self) -> int:
        steps = self.steps()
        return max(steps) if steps else -1


def differing_steps(logs: Sequence[dict[int, str]]) -> dict[int, set[str]]:
    """The steps at which the given step -> hash maps (one per peer) hold more than one hash."""
    by_step: dict[int, set[str]] = {}
    for steps in logs:
        for step, digest in steps.items():
            by_step.setdefault(step, set()).add(digest)
    return {step: hashes for step, hashes in by_step.items() if len(hashes) > 1}


@dataclass
class Swarm:
    tmp: Path
    bootstrap: hivemind.DHT
    maddr: str
    peers: list[Peer] = field(default_factory=list)

    def write_config(self, data: dict[str, Any]) -> Path:
        path = self.tmp / "run.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    def start(
        self,
        config: Path,
        device_index: int,
        *,
        env: dict[str, str] | None = None,
        max_steps: int | None = None,
        launcher: list[str] | None = None,
        extra: Sequence[str] = (),
    ) -> Peer:
        """Start ``collab join`` (or ``launcher`` with the same arguments) for ``device_index``; ``extra``
        flags come last (a repeated flag overrides the default)."""
        n = len(self.peers)
        log, err = self.tmp / f"peer{n}.jsonl", self.tmp / f"peer{n}.err"
        cmd = [
            *(launcher or COLLAB), "--log-level", "INFO", "join",
            "--config", str(config), "--initial-peers", self.maddr,
            "--device-index", str(device_index), "--log-file", str(log), "--json", "--linger", "3",
        ]  # fmt: skip
        if max_steps is not None:
            cmd += ["--max-steps", str(max_steps)]
        cmd += extra
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err.open("w"),
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        peer = Peer(n, proc, log, err)
        self.peers.append(peer)
        return peer

    def overview(self) -> str:
        """One line per peer started (its key, last step, exit code, failed rounds, last warning): which
        peer was where when a test fails, in a CI log that keeps only part of the peers' output."""
        lines = []
        for p in self.peers:
            text = p.err.read_text() if p.err.exists() else ""
            first = next((x for x in text.splitlines() if ": peer " in x), "")
            key = first.split(": peer ", 1)[1].split(",", 1)[0][-6:] if first else "?"
            failed = sum(1 for r in p.records() if r.get("event") == "round_failed")
            warn = next((x for x in reversed(text.splitlines()) if " WARN " in x), "")[:160]
            lines.append(
                f"peer {p.index} {key}: step {p.last_step()}, exit {p.proc.poll()}, {failed} failed rounds"
                + (f"; last warning: {warn}" if warn else "")
            )
        return "\n".join(lines)

    def kill(self, peer: Peer) -> None:
        """SIGKILL the peer's whole process group (peer, DHT process, p2pd)."""
        if group_alive(peer.proc.pid):
            os.killpg(peer.proc.pid, signal.SIGKILL)
        peer.proc.wait(timeout=30)

    def wait_until(self, predicate: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        tails = "\n".join(f"--- peer {p.index}:\n" + p.err.read_text()[-1500:] for p in self.peers)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{self.overview()}\n{tails}")

    def finish(self, peer: Peer, timeout_s: float) -> dict[str, Any]:
        try:
            out, _ = peer.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill(peer)
            raise AssertionError(
                f"peer {peer.index} did not finish in {timeout_s}s:\n{self.overview()}\n"
                f"{peer.err.read_text()[-3000:]}"
            ) from None
        assert peer.proc.returncode == 0, (
            f"peer {peer.index} exited {peer.proc.returncode}:\n{self.overview()}\n"
            f"{peer.err.read_text()[-3000:]}"
        )
        return json.loads(out.strip().splitlines()[-1])

    def stop(self, peers: Sequence[Peer], timeout_s: float) -> list[dict[str, Any]]:
        """SIGTERM every one of ``peers`` at once (each leaves after its current round, exit 0), then
        their summaries. For runs the test ends once it has seen what it checks, not at ``max_steps``."""
        for peer in peers:
            if peer.proc.poll() is None:
                peer.proc.send_signal(signal.SIGTERM)
        return [self.finish(peer, timeout_s) for peer in peers]


@pytest.fixture
def node_trio() -> Iterator[Callable[[], list[SwarmNode]]]:
    """Makes three fresh in-process nodes (each with its own p2pd, the others bootstrapped from the
    first), in order; every node made is shut down after the test."""
    nodes: list[SwarmNode] = []

    def make() -> list[SwarmNode]:
        first = SwarmNode()
        nodes.append(first)
        nodes.extend(SwarmNode(initial_peers=first.visible_maddrs()) for _ in range(2))
        return nodes[-3:]

    try:
        yield make
    finally:
        for n in reversed(nodes):
            n.shutdown()


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    """A bootstrap DHT on 127.0.0.1 plus helpers to start peers; at teardown every process is reaped by PID
    and the test fails if any p2pd or peer process outlived it."""
    before = p2pd_pids()
    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    sw = Swarm(tmp_path, boot, str(boot.get_visible_maddrs()[0]))
    try:
        yield sw
    finally:
        for peer in sw.peers:
            if peer.proc.poll() is None or group_alive(peer.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(peer.proc.pid, signal.SIGKILL)
                peer.proc.wait(timeout=30)
        boot.shutdown()
        sessions = {p.proc.pid for p in sw.peers}  # each peer leads its own session (start_new_session)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            owned(p2pd_pids() - before, sessions) or any(group_alive(p.proc.pid) for p in sw.peers)
        ):
            time.sleep(0.1)
        leftover_p2pd = owned(p2pd_pids() - before, sessions)
        leftover_groups = [p.proc.pid for p in sw.peers if group_alive(p.proc.pid)]
        for pid in leftover_p2pd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not leftover_p2pd, f"p2pd processes left behind: {sorted(leftover_p2pd)}"
        assert not leftover_groups, f"peer process groups left behind: {leftover_groups}"
