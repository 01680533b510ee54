"""ModelKeeper: follow a run without training and keep versioned checkpoints of its model.

The seed run's "auxiliary peer" at collab's scale. The keeper reads the run's alive records, and every
``every`` steps (and at the run's last step) downloads the state of the most advanced volunteer with the
same hash- and vouch-checked call late joiners use (:mod:`collab.swarm.state_sync`), checks that it fits
the run's method (parameter count, optimizer tensors), and writes ``step-NNNNNN.ckpt`` atomically into
its folder (the same checkpoint format as ``collab join --checkpoint``, with the run config inside, so
``collab export`` and ``collab generate`` take it as it is). Then it hands the state to ``on_state``
(for instance a gallery of samples).

It never slows the volunteers' rounds: it publishes no alive record, so it is never expected in a group
and never chosen as a sync source; it takes part in no round; it downloads at most once per ``every``
steps, from one peer at a time, with the run's state-sync deadline. Its own CPU use is the caller's to
bound (``collab keeper`` runs at low priority on one thread).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from collab.config import RunConfig
from collab.methods.base import Method, MethodState
from collab.methods.checkpoint import encode_checkpoint, write_checkpoint
from collab.swarm.records import alive_key, parse_alive
from collab.swarm.state_sync import (
    Partial,
    StateRejected,
    StateSource,
    Vouches,
    alive_steps,
    download_state,
)
from collab.swarm.timing import Timing
from collab.swarm.transport import SwarmNode

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"^step-(\d{6,})\.ckpt$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}.ckpt"


def kept_steps(folder: str | Path) -> list[int]:
    """Steps of the checkpoints a keeper wrote in ``folder``, oldest first."""
    path = Path(folder)
    if not path.is_dir():
        return []
    found = (CHECKPOINT_NAME.match(p.name) for p in path.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


class ModelKeeper:
    """``ModelKeeper(cfg, node, method=m, folder=DIR, every=N).run(stop)``: checkpoints every N steps.

    ``method`` is a method of this run (its parameters are never stepped): downloaded states are checked
    by adopting them into it. ``keep_last`` > 0 deletes all but the newest ``keep_last`` checkpoints.
    """

    def __init__(
        self,
        cfg: RunConfig,
        node: SwarmNode,
        *,
        method: Method,
        folder: str | Path,
        every: int,
        keep_last: int = 0,
        on_state: Callable[[MethodState], None] | None = None,
    ) -> None:
        if every < 1:
            raise ValueError("every must be at least 1")
        self.cfg, self.node, self.method = cfg, node, method
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.every, self.keep_last, self.on_state = every, keep_last, on_state
        self.source = StateSource(
            config_version=cfg.version(), method=method.name, timing=Timing.of(cfg.swarm)
        )
        self.vouches = Vouches(node, cfg.run_id, self.source.timing, alone_ok=cfg.swarm.min_group_size < 2)
        existing = kept_steps(self.folder)
        self.last_kept = existing[-1] if existing else -1  # a restarted keeper goes on where it stopped
        self._suspects: dict[str, float] = {}  # peer -> monotonic time until which it is skipped
        self._partial = Partial()  # a download that broke off: the next try resumes it

    def due(self, step: int) -> bool:
        """Whether a state at ``step`` is worth keeping: ``every`` steps past the last one, or the end."""
        if step <= self.last_kept:
            return False
        return step >= self.last_kept + self.every or step >= self.cfg.max_steps or self.last_kept < 0

    def poll_once(self) -> MethodState | None:
        """Look at the run once; download, check and keep a state if one is due. The kept state or
        ``None``."""
        try:
            alive = parse_alive(
                self.node.get_dict(alive_key(self.cfg.run_id), timeout_s=self.source.timing.dht_s)
            )
        except Exception as e:  # hivemind reports a slow or unreachable DHT in several ways: look again
            logger.warning("keeper: cannot read the run's alive records: %s", e)
            return None
        now = time.monotonic()
        for step, peer in alive_steps(alive, sources=True):
            if not self.due(step):
                return None  # the most advanced usable peer is not far enough ahead yet
            if self._suspects.get(peer, 0.0) > now:
                continue
            try:
                state = download_state(self.node, peer, self.source, partial=self._partial).state
                self.vouches.check(state, peer, alive)  # more than one member vouches for it
                self.method.adopt_state(state)  # checks shapes and optimizer tensors
            except (StateRejected, ValueError) as e:
                logger.warning("keeper: not taking the state of %s: %s", peer[-6:], e)
                self._suspects[peer] = now + self.source.timing.suspect_s
                continue
            if not self.due(state.step):  # it moved on or fell back since its alive record
                return None
            try:
                self._keep(state)
            except OSError as e:  # a full or read-only disk: say so, and try again at the next poll
                logger.error("keeper: cannot write to %s: %s", self.folder, e)
                return None
            return state
        return None

    def _keep(self, state: MethodState) -> None:
        data = encode_checkpoint(
            state, config_version=self.source.config_version, method=self.method.name, config=self.cfg
        )
        path = self.folder / checkpoint_name(state.step)
        write_checkpoint(path, data)
        self.last_kept = state.step
        logger.info("keeper: kept step %d (%s) in %s", state.step, state.hash()[:12], path)
        if self.keep_last > 0:
            for old in kept_steps(self.folder)[: -self.keep_last]:
                (self.folder / checkpoint_name(old)).unlink(missing_ok=True)
        if self.on_state is not None:
            self.on_state(state)

    def run(self, stop: threading.Event, *, poll_interval_s: float | None = None) -> int:
        """Poll until ``stop`` or until the run's last step is kept; returns the last kept step."""
        interval = poll_interval_s or self.cfg.swarm.heartbeat_interval_s / 2
        while not stop.is_set() and self.last_kept < self.cfg.max_steps:
            self.poll_once()
            stop.wait(interval)
        return self.last_kept
