"""Serving this peer's state to others, and catching up with the run from theirs.

:class:`StateService` answers ``collab.state`` calls with the committed state, and tells a requester
which of the groups it asks about committed with its contribution (see ``Method.adopt_state``).
:class:`Catchup` downloads the state of the most advanced peer ahead (a late joiner, a peer that lost
rounds) or of a round's leader that holds another state at the same step, checks it, and adopts it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from collab.methods.base import Method, MethodState
from collab.swarm.aggregator import SwarmAggregator
from collab.swarm.state_sync import (
    ForgedState,
    Partial,
    StateRejected,
    StateServer,
    StateSource,
    Vouches,
    alive_steps,
    download_state,
)
from collab.swarm.transport import SwarmNode

logger = logging.getLogger(__name__)


class StateService:
    """Serves ``method``'s committed state in chunks (never to banned peers; see
    :mod:`collab.swarm.state_sync`)."""

    def __init__(
        self,
        *,
        node: SwarmNode,
        method: Method,
        aggregator: SwarmAggregator,
        config_version: str,
        chunk_bytes: int,
    ):
        self.method, self.aggregator = method, aggregator
        StateServer(
            node,
            state=lambda: self.served(),
            method=method.name,
            config_version=config_version,
            chunk_bytes=chunk_bytes,
            banned=aggregator.bans.is_banned,
            used=lambda rounds, remote: [g for g in rounds if aggregator.contributed(g, remote)],
        )

    def served(self) -> MethodState | None:
        """The state a manifest hands out: the committed one."""
        return self.method.state


class Catchup:
    """Adopts checked states from other peers - hash-checked, and vouched for by more than one member
    (``vouches``); a source whose state other members contradict is banned. ``emit`` receives one event
    per adopted state."""

    def __init__(
        self,
        *,
        node: SwarmNode,
        method: Method,
        aggregator: SwarmAggregator,
        source: StateSource,
        vouches: Vouches,
        emit: Callable[..., None],
        name: str,
    ) -> None:
        self.node, self.method, self.aggregator, self.source = node, method, aggregator, source
        self.vouches = vouches
        self.emit, self.name = emit, name
        self._last_mismatch: tuple[str, int] | None = None
        self._partial = Partial()  # a download that broke off: the next try resumes it

    @property
    def step(self) -> int:
        return self.method.state.step if self.method.state is not None else -1

    def peers_ahead(self) -> list[tuple[int, str]]:
        """Peers ahead of us, most advanced first. A method whose initial state needs no round computes it
        itself rather than download it (and vouches for it like everyone else)."""
        view = self.aggregator.matchmaker.alive_peers
        floor = 0 if self.method.local_start and self.step < 0 else self.step
        return [(s, p) for s, p in alive_steps(view, exclude=self.node.peer_key, sources=True) if s > floor]

    def follow(self, peers: list[str], wait_s: float, stop: Callable[[float], bool]) -> bool:
        """This peer is out of a round that some of ``peers`` may commit (a confirmation went unanswered,
        a group left it out): wait (up to ``wait_s``, or until ``stop(seconds)`` says to stop) for one of
        them to show a step past ours in the alive view, and take its state. ``False`` when none moves
        ahead."""
        deadline = time.monotonic() + wait_s
        members = set(peers)
        while time.monotonic() < deadline:
            if any(p in members for _, p in self.peers_ahead()):
                return self.sync()
            if stop(self.source.timing.vouch_poll_s):
                return False
        return False

    def sync(self, source: str | None = None) -> bool:
        """Download the state of the most advanced peer ahead of us (or of ``source``, even at our step);
        ``True`` if one was adopted."""
        matchmaker = self.aggregator.matchmaker
        candidates = [(self.step, source)] if source is not None else self.peers_ahead()
        for _step, peer in candidates:
            if matchmaker.is_suspect(peer):
                continue
            try:
                got = download_state(
                    self.node, peer, self.source, rounds=self.method.pending_rounds, partial=self._partial
                )
                self.vouches.check(got.state, peer, matchmaker.alive_peers)
                self.method.adopt_state(got.state, used=got.used)
            except ForgedState as e:
                logger.warning("%s: not taking the state of %s: %s", self.name, peer[-6:], e)
                self.aggregator.bans.ban(peer, f"forged state: {e}", f"{got.state.step}.state")
                continue
            except (StateRejected, ValueError) as e:  # ValueError: the right hash, but other shapes
                logger.warning("%s: not taking the state of %s: %s", self.name, peer[-6:], e)
                matchmaker.suspect(peer)
                continue
            self.aggregator.committed.clear()  # our lineage is now the source's
            state = got.state
            logger.info("%s: synchronized to step %d from %s", self.name, state.step, peer[-6:])
            self.emit(
                event="sync", step=state.step, source=peer, hash=state.hash(), kept_residual=bool(got.used)
            )
            return True
        return False

    def resolve_mismatch(self, leader: str) -> bool:
        """Take the state of a leader that holds another state at our step - once per (leader, step): a
        leader that still disagrees after we took its own state is lying, and is avoided."""
        self.emit(event="state_mismatch", step=self.step, leader=leader)
        if self._last_mismatch == (leader, self.step):
            logger.warning("%s: %s keeps refusing its own state; avoiding it", self.name, leader[-6:])
            self.aggregator.matchmaker.suspect(leader)
            return False
        self._last_mismatch = (leader, self.step)
        logger.warning(
            "%s step %d: leader %s holds another state; taking it", self.name, self.step, leader[-6:]
        )
        return self.sync(source=leader)
