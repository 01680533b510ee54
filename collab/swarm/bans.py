"""Bans: peers this peer caught sending an invalid contribution, excluded from its rounds for a while.

A ban is local: a peer bans only what it verified itself (as the owner of a part, or on a reduced part
everyone received), never on another peer's word, so a malicious peer cannot get honest ones banned by
accusing them. Every honest owner that receives a bad contribution bans its sender, which in practice
means every honest member of the group. While banned, a peer is skipped as leader and as member,
refused when it asks to join, its parts are dropped, and it gets no state. Ban events are kept for the
progress records (the monitor shows them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BanEvent:
    peer: str
    reason: str
    round_id: str
    time: float  # wall clock (DHT time), seconds
    until: float  # wall clock, seconds


class Bans:
    """``ban(peer, reason, round_id)``; ``is_banned(peer)``; ``events`` (newest last, bounded)."""

    def __init__(
        self, *, duration_s: float, me: str = "", on_ban: Callable[[BanEvent], None] | None = None
    ) -> None:
        self.duration_s, self.me, self.on_ban = duration_s, me, on_ban
        self._until: dict[str, float] = {}
        self.events: list[BanEvent] = []
        self._lock = threading.Lock()

    def ban(self, peer: str, reason: str, round_id: str = "") -> None:
        if peer == self.me:
            return
        now = time.time()
        with self._lock:
            fresh = self._until.get(peer, 0.0) <= now
            self._until[peer] = now + self.duration_s
            event = BanEvent(peer, reason, round_id, now, now + self.duration_s)
            if fresh:
                self.events = [*self.events[-49:], event]
        if fresh:
            logger.warning("banned %s for %.0fs (round %s): %s", peer[-6:], self.duration_s, round_id, reason)
            if self.on_ban is not None:
                self.on_ban(event)

    def is_banned(self, peer: str) -> bool:
        return self._until.get(peer, 0.0) > time.time()

    def active_peers(self) -> list[str]:
        """The peers banned now, sorted."""
        now = time.time()
        with self._lock:
            return sorted(p for p, until in self._until.items() if until > now)

    def active(self) -> list[BanEvent]:
        now = time.time()
        with self._lock:
            latest = {e.peer: e for e in self.events}
        return [e for e in latest.values() if self._until.get(e.peer, 0.0) > now]
