"""Volunteer: one peer's training loop - join, synchronize, step, publish, leave cleanly.

Knows the swarm pieces and the method; knows nothing of command lines. Progress goes to an optional
JSON-lines log (one object per step or event) that tests and tools read; the signed DHT records that
the monitor reads arrive with the monitor.

Liveness: every ``heartbeat_interval_s`` a peer stores ``{step, device, status}`` under
``{run_id}_alive`` (subkey: its peer key) with a ``heartbeat_ttl_s`` expiration. A peer that starts
late, or that finds itself behind after a failed round, downloads the state from a peer that is ahead
(``collab.state``), checks its hash, and continues from there with fresh device buffers.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hivemind.utils import get_dht_time

from collab.config import RunConfig
from collab.methods.base import Method, RoundFailed, TimeBudget
from collab.methods.build import build_method
from collab.methods.checkpoint import CheckpointError, encode_checkpoint, read_checkpoint, write_checkpoint
from collab.swarm.aggregator import SwarmAggregator
from collab.swarm.bans import BanEvent
from collab.swarm.matchmaking import StateMismatch
from collab.swarm.records import PeerStatus
from collab.swarm.state_sync import STATE, StateRejected, StateSource, alive_steps, download_state
from collab.swarm.transport import Header, SwarmNode
from collab.tasks.base import Throttled
from collab.tasks.build import build_task

logger = logging.getLogger(__name__)


class ConfigMismatch(RuntimeError):
    """This peer's run config is not the one the swarm runs."""


class Volunteer:
    """``Volunteer(cfg, node, device_index=m).run(max_steps=N)`` trains device ``m``'s shard in the swarm."""

    def __init__(
        self,
        cfg: RunConfig,
        node: SwarmNode,
        *,
        device_index: int,
        log_path: str | Path | None = None,
        name: str | None = None,
        signer: Any = None,
        checkpoint_path: str | Path | None = None,
        checkpoint_every: int = 0,
        device: str = "cpu",
        precision: str = "fp32",
        client_mode: bool = False,
        batch_size: int | None = None,
        throttle: float = 1.0,
    ) -> None:
        if not 0 <= device_index < cfg.num_devices:
            raise ValueError(f"device index {device_index} outside [0, {cfg.num_devices})")
        self.cfg, self.node, self.device_index = cfg, node, device_index
        self.name = name or f"peer-{node.peer_key[-6:]}"
        # batch size and throttle are this volunteer's own choice: not in the run's config (nor its
        # version); contributions are weighted by the samples behind them
        self.task = build_task(cfg, device=device, precision=precision, batch_size=batch_size)
        self.aggregator = SwarmAggregator(
            node=node,
            run_id=cfg.run_id,
            cfg=cfg.swarm,
            device_index=device_index,
            shared_seed=cfg.seed,
            config_version=cfg.version(),
        )
        self.method: Method = build_method(
            cfg, self.task, self.aggregator, [device_index], device_keys=[node.peer_key]
        )
        if throttle < 1:
            for worker in self.method.workers:
                worker.operator = Throttled(worker.operator, throttle)
        if cfg.swarm.round_time_s is not None:
            self.method.microbatches = TimeBudget(cfg.swarm.round_time_s)
        self.aggregator.bans.on_ban = self._on_ban
        self.aggregator.matchmaker.state_hash = self._state_hash
        self.stop_event = threading.Event()
        self.status = PeerStatus.STARTING
        self.signer, self.device, self.client_mode = signer, device, client_mode
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.checkpoint_every = checkpoint_every  # steps between checkpoints (0: on exit only)
        self.config_version = cfg.version()
        self.samples = 0
        self._last_step_time = time.monotonic()
        self.on_step: Callable[[dict[str, Any]], None] | None = None
        self._log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115 (closed in close())
        self._alive_key = f"{cfg.run_id}_alive"
        self._failures_in_row = 0
        self._last_mismatch: tuple[str, int] | None = None
        node.serve(STATE, self._handle_state)
        self._beat_stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat_loop, name="collab-heartbeat", daemon=True)
        self._beat.start()

    # ---- reporting ---------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.method.state.step if self.method.state is not None else -1

    def _emit(self, **record: Any) -> None:
        record = {"time": round(time.time(), 3), "peer": self.node.peer_key, **record}
        if self._log is not None:
            self._log.write(json.dumps(record) + "\n")
        if self.on_step is not None and "event" not in record:
            self.on_step(record)

    def _state_hash(self) -> str | None:
        state = self.method.state
        return state.hash() if state is not None else None

    def _on_ban(self, event: BanEvent) -> None:
        """Log a ban and publish this peer's current bans (signed) for the monitor."""
        self._emit(event="ban", step=self.step, banned=event.peer, reason=event.reason, round=event.round_id)
        if self.signer is None:
            return
        from collab.swarm.records import BanEntry, BanReport, bans_key

        entries = [
            BanEntry(peer=e.peer, reason=e.reason[:200], round_id=e.round_id, time=e.time, until=e.until)
            for e in self.aggregator.bans.active()
        ]
        report = BanReport(name=self.name, bans=entries, time=float(get_dht_time()))
        expiration = get_dht_time() + self.cfg.swarm.ban_duration_s
        self.node.spawn(
            self.node.dht_store(
                bans_key(self.cfg.run_id), self.signer.local_public_key, report.dict(), expiration
            )
        )

    def _heartbeat_loop(self) -> None:
        cfg = self.cfg.swarm
        while not self._beat_stop.is_set():
            try:
                self.publish_alive()
                self._refresh_view()
            except Exception as e:  # the DHT being slow is not fatal: try again next beat
                logger.debug("%s: heartbeat failed: %s", self.name, e)
            self._beat_stop.wait(cfg.heartbeat_interval_s)

    def publish_alive(self, status: PeerStatus | None = None) -> None:
        value = {
            "step": self.step,
            "device": self.device_index,
            "status": (status or self.status).value,
            "name": self.name,
        }
        expiration = get_dht_time() + self.cfg.swarm.heartbeat_ttl_s
        self.node.run(
            self.node.dht_store(self._alive_key, self.node.peer_key, value, expiration), timeout_s=10.0
        )

    # ---- state sync --------------------------------------------------------------------------------
    async def _handle_state(self, header: Header, payload: bytes, remote: str) -> tuple[Header, bytes]:
        if self.aggregator.bans.is_banned(remote):
            raise PermissionError("banned from this run")
        state = self.method.state
        if state is None:
            raise RuntimeError("no state yet")
        header = {
            "step": state.step,
            "hash": state.hash(),
            "method": self.method.name,
            "version": self.config_version,
        }
        return header, state.to_bytes()

    def _peers_ahead(self) -> list[tuple[int, str]]:
        view = self.aggregator.matchmaker.alive_peers
        return [(s, p) for s, p in alive_steps(view, exclude=self.node.peer_key) if s > self.step]

    def sync(self, source: str | None = None) -> bool:
        """Download the state of the most advanced peer ahead of us (or of ``source``, even at our step);
        ``True`` if one was adopted."""
        candidates = [(self.step, source)] if source is not None else self._peers_ahead()
        expected = StateSource(
            config_version=self.config_version,
            method=self.method.name,
            timeout_s=self.cfg.swarm.state_sync_timeout_s,
        )
        for _step, peer in candidates:
            if self.aggregator.matchmaker.is_suspect(peer):
                continue
            try:
                state = download_state(self.node, peer, expected)
                self.method.adopt_state(state)
            except (StateRejected, ValueError) as e:  # ValueError: the right hash, but other shapes
                logger.warning("%s: not taking the state of %s: %s", self.name, peer[-6:], e)
                self.aggregator.matchmaker.suspect(peer)
                continue
            logger.info("%s: synchronized to step %d from %s", self.name, state.step, peer[-6:])
            self._emit(event="sync", step=state.step, source=peer, hash=state.hash())
            return True
        return False

    def _resolve_mismatch(self, leader: str) -> bool:
        """Take the state of a leader that holds another state at our step - once per (leader, step): a
        leader that still disagrees after we took its own state is lying, and is avoided."""
        self._emit(event="state_mismatch", step=self.step, leader=leader)
        if self._last_mismatch == (leader, self.step):
            logger.warning("%s: %s keeps refusing its own state; avoiding it", self.name, leader[-6:])
            self.aggregator.matchmaker.suspect(leader)
            return False
        self._last_mismatch = (leader, self.step)
        logger.warning(
            "%s step %d: leader %s holds another state; taking it", self.name, self.step, leader[-6:]
        )
        return self.sync(source=leader)

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self, *, max_steps: int | None = None, give_up_after_s: float | None = None) -> int:
        """Train until ``max_steps`` (default: the config's), ``stop_event``, or no progress for
        ``give_up_after_s`` (default: 6 x (matchmaking + all-reduce timeouts)). Failed rounds are retried
        with exponential backoff (50 ms up to 2 s). Returns the last committed step.
        """
        sw = self.cfg.swarm
        patience = give_up_after_s or 6 * (sw.matchmaking_timeout_s + sw.allreduce_timeout_s)
        last_progress = time.monotonic()
        target = max_steps if max_steps is not None else self.cfg.max_steps
        self.status = PeerStatus.SYNCING
        self._wait_for_view()
        self.check_config_version()
        self.sync()
        self.status = PeerStatus.TRAINING
        while self.step < target and not self.stop_event.is_set():
            try:
                if self.method.state is None:
                    self.method.initialize()
                    self._emit(
                        event="initialized",
                        step=0,
                        hash=self.method.state.hash() if self.method.state else None,
                    )
                    continue
                report = self.method.step()
            except RoundFailed as e:
                self._failures_in_row += 1
                logger.info("%s step %d: round failed (%s)", self.name, self.step, e)
                self._emit(event="round_failed", step=self.step, reason=str(e))
                if time.monotonic() - last_progress > patience:
                    logger.warning("%s: no progress for %.0fs; stopping", self.name, patience)
                    break
                self.check_config_version()
                adopted = False
                if isinstance(e, StateMismatch):  # two groups once committed this step apart
                    adopted = self._resolve_mismatch(e.peer)
                if adopted or self.sync():
                    last_progress = time.monotonic()
                else:
                    self.stop_event.wait(min(2.0, 0.05 * 2 ** min(self._failures_in_row - 1, 6)))
                continue
            self._failures_in_row = 0
            if self.checkpoint_every and report.step % self.checkpoint_every == 0:
                self.save_checkpoint()  # a peer killed later resumes from here
            last_progress = time.monotonic()
            assert self.method.state is not None
            stats = self.aggregator.stats
            samples_per_s = self._publish_progress(report.step)
            self._emit(
                step=report.step,
                samples_per_s=round(samples_per_s, 3),
                hash=self.method.state.hash(),
                metric=self.task.metric(self.method.state.z),
                group=self.aggregator.last_group_size,
                samples=self.method.last_samples,
                share=round(self.aggregator.reducer.last_share, 4),
                members=self.aggregator.last_group.peers if self.aggregator.last_group else [],
                refreshed=report.refreshed,
                bits_up=stats.bits_up,
                bits_down=stats.bits_down,
                wire_sent=stats.wire_bytes_sent,
                wire_received=stats.wire_bytes_received,
            )
        self.status = PeerStatus.DONE
        return self.step

    def check_config_version(self) -> None:
        """Refuse to train with a config that differs from the swarm's.

        The coordinator's alive record, when there is one, says which config is the run's; without a
        coordinator the majority of the other alive peers does (a tie keeps this peer running).
        """
        me, mine = self.node.peer_key, self.config_version
        versions = {
            p: (rec.get("version"), rec.get("status"))
            for p, rec in self.aggregator.matchmaker.alive_peers.items()
            if p != me and isinstance(rec, dict) and isinstance(rec.get("version"), str)
        }
        coordinator = [v for v, status in versions.values() if status == PeerStatus.COORDINATOR]
        others = [v for v, status in versions.values() if status != PeerStatus.COORDINATOR]
        if coordinator:
            swarm_version = coordinator[0]
            wrong = swarm_version != mine
        else:
            differing = [v for v in others if v != mine]
            swarm_version = differing[0] if differing else mine
            wrong = len(differing) > len(others) - len(differing)
        if wrong:
            raise ConfigMismatch(
                f"this peer's config (version {mine}) differs from the swarm's (version {swarm_version}): "
                "use the run's config (collab join --coordinator URL fetches it)"
            )

    def _publish_progress(self, step: int) -> float:
        """Store our signed progress record (fire and forget: a slow DHT never stalls training).

        Returns this step's samples per second."""
        now = time.monotonic()
        elapsed, self._last_step_time = now - self._last_step_time, now
        batch = int(self.method.last_samples)
        self.samples += batch
        samples_per_s = batch / elapsed if elapsed > 0 else 0.0
        if self.signer is None:
            return samples_per_s
        from collab import __version__
        from collab.swarm.records import ProgressRecord, progress_key

        assert self.method.state is not None
        stats = self.aggregator.stats
        metric = float(self.task.metric(self.method.state.z))
        record = ProgressRecord(
            step=step,
            samples=self.samples,
            samples_per_s=float(samples_per_s),
            metric=metric,
            metric_name=self.task.metric_name,
            bits_up=float(stats.bits_up),
            bits_down=float(stats.bits_down),
            wire_sent=int(stats.wire_bytes_sent),
            wire_received=int(stats.wire_bytes_received),
            group_size=int(self.aggregator.last_group_size),
            round_share=float(self.aggregator.reducer.last_share),
            device=self.device,
            client_mode=self.client_mode,
            software_version=__version__,
            config_version=self.config_version,
            name=self.name,
            time=float(get_dht_time()),
        )
        expiration = get_dht_time() + max(30.0, 10 * self.cfg.swarm.heartbeat_ttl_s)
        self.node.spawn(
            self.node.dht_store(
                progress_key(self.cfg.run_id), self.signer.local_public_key, record.dict(), expiration
            )
        )
        return samples_per_s

    def save_checkpoint(self) -> None:
        """Write the committed state atomically (temp file, fsync, rename): a crash never leaves half a
        file. The file names the config version and method and carries the run config, so `collab export`
        needs nothing else (collab/methods/checkpoint.py)."""
        if self.checkpoint_path is None or self.method.state is None:
            return
        data = encode_checkpoint(
            self.method.state, config_version=self.config_version, method=self.method.name, config=self.cfg
        )
        write_checkpoint(self.checkpoint_path, data)

    def load_checkpoint(self, path: str | Path) -> bool:
        """Start from the checkpoint at ``path`` (before :meth:`run`); ``False`` if there is none.

        Raises :class:`CheckpointError` (one line: corrupt, truncated, another config or method) and then
        loads nothing. A loaded state is like a downloaded one: :meth:`run` still syncs to peers ahead.
        """
        state = read_checkpoint(path, config_version=self.config_version, method=self.method.name)
        if state is None:
            return False
        try:
            self.method.adopt_state(state)
        except ValueError as e:  # same config version, other shapes: only a changed task could do this
            raise CheckpointError(f"checkpoint {path} does not fit this run ({e}); not loaded") from None
        logger.info("%s: resumed from checkpoint %s at step %d", self.name, path, state.step)
        self._emit(event="resumed", step=state.step, hash=state.hash(), path=str(path))
        return True

    def _wait_for_view(self) -> None:
        """Learn who is alive before deciding to sync or initialize (peers that start together meet)."""
        time.sleep(self.cfg.swarm.heartbeat_interval_s)
        deadline = time.monotonic() + 2 * self.cfg.swarm.heartbeat_interval_s
        while True:
            self._refresh_view()
            if time.monotonic() >= deadline or len(self.aggregator.matchmaker.alive_peers) > 1:
                return
            time.sleep(0.1)

    def _refresh_view(self) -> None:
        alive = self.node.run(self.node.dht_get_dict(self._alive_key), timeout_s=10.0)
        self.aggregator.matchmaker.alive_peers = {
            p: v for p, v in alive.items() if isinstance(v, dict) and v.get("status") != PeerStatus.LEFT
        }

    def close(self, linger_s: float = 0.0) -> None:
        """Leave: keep serving ``linger_s`` (late peers may still sync), mark us gone, stop heartbeats."""
        self.save_checkpoint()
        if linger_s > 0:
            time.sleep(linger_s)
        self._beat_stop.set()
        self._beat.join(timeout=5.0)
        try:
            self.publish_alive(status=PeerStatus.LEFT)
        except Exception as e:  # leaving anyway
            logger.debug("%s: could not publish departure: %s", self.name, e)
        if self._log is not None:
            self._log.close()
            self._log = None


class CoordinatorBeacon:
    """The coordinator's alive record: tells joining peers which config version is the run's."""

    def __init__(self, cfg: RunConfig, node: SwarmNode) -> None:
        self.cfg, self.node = cfg, node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="collab-beacon", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        sw = self.cfg.swarm
        value = {
            "step": -1,
            "device": -1,
            "status": PeerStatus.COORDINATOR.value,
            "name": "coordinator",
            "version": self.cfg.version(),
        }
        while not self._stop.is_set():
            try:
                expiration = get_dht_time() + sw.heartbeat_ttl_s
                self.node.run(
                    self.node.dht_store(f"{self.cfg.run_id}_alive", self.node.peer_key, value, expiration),
                    timeout_s=10.0,
                )
            except Exception as e:  # the DHT being slow is not fatal: try again next beat
                logger.debug("coordinator beacon failed: %s", e)
            self._stop.wait(sw.heartbeat_interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
