"""Liveness: a peer's alive record, stored again every beat, and the view of who else is alive.

Every ``heartbeat_interval_s`` a peer stores its :class:`~collab.swarm.records.AliveRecord` (the
coordinator's names the run's config version) under ``{run_id}_alive`` (subkey: its peer key) with a
``heartbeat_ttl_s`` expiration, and reads everyone's back. A record that expires means the peer left; a
peer that leaves cleanly stores a last record with status ``left``; a malformed record is not counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hivemind.utils import get_dht_time

from collab.config import SwarmConfig
from collab.swarm.records import AliveRecord, alive_key, parse_alive
from collab.swarm.timing import Timing
from collab.swarm.transport import SwarmNode

logger = logging.getLogger(__name__)

AliveView = dict[str, AliveRecord]

__all__ = ["AliveView", "Heartbeat", "alive_key"]


class Heartbeat:
    """Stores ``record()`` every beat on a thread of its own; with ``on_view``, also reads the alive
    records back and hands the view (peers that have not left) to it."""

    def __init__(
        self,
        *,
        node: SwarmNode,
        run_id: str,
        cfg: SwarmConfig,
        record: Callable[[], AliveRecord],
        on_view: Callable[[AliveView], None] | None = None,
        name: str = "collab-heartbeat",
    ) -> None:
        self.node, self.cfg, self.record, self.on_view = node, cfg, record, on_view
        self.key = alive_key(run_id)
        self.timing = Timing.of(cfg)
        self._stop = threading.Event()
        self.first_stored: float | None = None  # when this peer's first record was stored (monotonic)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish()
                if self.on_view is not None:
                    self.refresh()
            except Exception as e:  # the DHT being slow is not fatal: try again next beat
                logger.debug("heartbeat failed: %s", e)
            self._stop.wait(self.cfg.heartbeat_interval_s)

    def publish(self, record: AliveRecord | None = None) -> None:
        """Store ``record`` (default: the current one) now."""
        expiration = get_dht_time() + self.cfg.heartbeat_ttl_s
        value = (record if record is not None else self.record()).to_wire()
        self.node.run(
            self.node.dht_store(self.key, self.node.peer_key, value, expiration), timeout_s=self.timing.dht_s
        )
        if self.first_stored is None:
            self.first_stored = time.monotonic()

    def wait_until_seen(self, stop: threading.Event, limit_s: float) -> None:
        """Return once every peer that reads the view each beat has read it since this peer's first
        record was stored (two beats after it; at once if it is older), when ``stop`` is set, or after
        ``limit_s`` (the DHT is failing: rounds go on as they can)."""
        give_up = time.monotonic() + limit_s
        while not stop.is_set() and time.monotonic() < give_up:
            first = self.first_stored
            left = None if first is None else first + 2 * self.cfg.heartbeat_interval_s - time.monotonic()
            if left is not None and left <= 0:
                return
            stop.wait(0.1 if left is None else min(left, 0.5))

    def refresh(self) -> AliveView:
        """Read the alive records now; hands the view to ``on_view`` and returns it."""
        alive = self.node.run(self.node.dht_get_dict(self.key), timeout_s=self.timing.dht_s)
        view = parse_alive(alive)
        if self.on_view is not None:
            self.on_view(view)
        return view

    def stop(self, *, last: AliveRecord | None = None) -> None:
        """Stop beating; store ``last`` (e.g. status ``left``) if given."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        if last is not None:
            try:
                self.publish(last)
            except Exception as e:  # leaving anyway
                logger.debug("could not publish the last alive record: %s", e)
