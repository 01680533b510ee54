"""Volunteer: one peer's training loop - join, synchronize, step, leave cleanly.

The loop itself is here; each of its collaborators does one job and is wired in the constructor:

* :class:`~collab.swarm.aggregator.SwarmAggregator` - matchmaking and the exact exchange of each round;
* :class:`~collab.swarm.heartbeat.Heartbeat` - this peer's alive record and the view of who is alive;
* :class:`~collab.swarm.catchup.StateService` / :class:`~collab.swarm.catchup.Catchup` - serving the
  state, and downloading a checked one when this peer starts late or falls behind;
* :class:`~collab.swarm.config_guard.ConfigGuard` - never training with another config than the run's;
* :class:`~collab.swarm.reporting.EventLog` / :class:`~collab.swarm.reporting.Reporter` - the JSON-lines
  log, the signed progress and ban records;
* :class:`~collab.swarm.checkpoints.Checkpointer` - the committed state on disk;
* :class:`~collab.swarm.budget.RoundBudget` - how long this device computes in a round.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from collab.config import RunConfig
from collab.methods.base import Method, RoundFailed
from collab.methods.build import build_method
from collab.swarm.aggregator import SwarmAggregator
from collab.swarm.bans import BanEvent, Bans
from collab.swarm.budget import RoundBudget
from collab.swarm.catchup import Catchup, StateService
from collab.swarm.checkpoints import Checkpointer
from collab.swarm.config_guard import ConfigGuard, ConfigMismatch
from collab.swarm.heartbeat import AliveView, Heartbeat
from collab.swarm.matchmaking import LeftBehind, StateMismatch
from collab.swarm.records import AliveRecord, PeerStatus
from collab.swarm.reporting import EventLog, Reporter, ban_line
from collab.swarm.state_sync import StateSource, Vouches
from collab.swarm.timing import Timing
from collab.swarm.transport import SwarmNode
from collab.tasks.base import Throttled
from collab.tasks.build import build_task

logger = logging.getLogger(__name__)
RATE_WARMUP_STEPS = 3

__all__ = ["ConfigMismatch", "CoordinatorBeacon", "Volunteer"]


def stall_reason(last: Exception, bans: Bans, cfg: RunConfig) -> str:
    """What kept a volunteer from progressing: the last round's failure and the peers it bans (a run
    whose groups need every volunteer cannot form one while any of them is banned)."""
    why = f"last round: {last}"
    banned = bans.active()
    if banned:
        why += "; banned here: " + ", ".join(f"{b.peer[-6:]} ({b.reason})" for b in banned[:3])
        if cfg.swarm.min_group_size >= cfg.num_devices:
            why += f"; min_group_size {cfg.swarm.min_group_size} needs every volunteer"
    return why


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
        batch_size: int | None = None,
        throttle: float = 1.0,
    ) -> None:
        if not 0 <= device_index < cfg.num_devices:
            raise ValueError(f"device index {device_index} outside [0, {cfg.num_devices})")
        self.cfg, self.node, self.device_index = cfg, node, device_index
        self.name = name or f"peer-{node.peer_key[-6:]}"
        self.config_version = cfg.version()
        self.timing = Timing.of(cfg.swarm)
        self.status = PeerStatus.STARTING
        self.stop_event = threading.Event()
        self.samples = 0
        self.rate: float | None = None  # samples per second of computation, smoothed (published)
        self._rate_steps = 0  # steps measured; the rate is published after RATE_WARMUP_STEPS of them
        self._last_step_time = time.monotonic()
        self._failures_in_row = 0

        self.log = EventLog(log_path, node.peer_key)
        self.reporter = Reporter(
            node=node, cfg=cfg, signer=signer, name=self.name, device=device, client_mode=node.client_mode
        )
        # batch size and throttle are this volunteer's own choice: not in the run's config (nor its
        # version); contributions are weighted by the samples behind them
        self.task = build_task(cfg, device=device, precision=precision, batch_size=batch_size)
        self.aggregator = SwarmAggregator(
            node=node,
            run_id=cfg.run_id,
            cfg=cfg.swarm,
            device_index=device_index,
            shared_seed=cfg.seed,
            config_version=self.config_version,
            state_hash=self._state_hash,
            on_ban=self._on_ban,
        )
        self.method: Method = build_method(
            cfg, self.task, self.aggregator, [device_index], device_keys=[node.peer_key]
        )
        if throttle < 1:
            for worker in self.method.workers:
                worker.operator = Throttled(worker.operator, throttle)
        if cfg.swarm.round_time_s is not None:
            self.method.microbatches = RoundBudget(
                round_time_s=cfg.swarm.round_time_s,
                target_batch_size=cfg.swarm.target_batch_size,
                timing=self.timing,
                members=self.aggregator.prepared_members,
                alive=lambda: self.aggregator.matchmaker.alive_peers,
                ratio=cfg.swarm.max_weight_ratio,
            )
        self.guard = ConfigGuard(node.peer_key, self.config_version)
        self.checkpoints = Checkpointer(
            path=checkpoint_path, every=checkpoint_every, cfg=cfg, method=self.method
        )
        self.catchup = Catchup(
            node=node,
            method=self.method,
            aggregator=self.aggregator,
            source=StateSource(
                config_version=self.config_version, method=self.method.name, timing=self.timing
            ),
            vouches=Vouches(node, cfg.run_id, self.timing, alone_ok=cfg.swarm.min_group_size < 2),
            emit=self.log.emit,
            name=self.name,
        )
        StateService(
            node=node,
            method=self.method,
            aggregator=self.aggregator,
            config_version=self.config_version,
            chunk_bytes=min(cfg.swarm.state_chunk_bytes, cfg.swarm.max_message_bytes),
        )
        self.heartbeat = Heartbeat(
            node=node, run_id=cfg.run_id, cfg=cfg.swarm, record=self._alive_record, on_view=self._on_view
        )

    # ---- wiring ------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.method.state.step if self.method.state is not None else -1

    @property
    def on_step(self) -> Any:
        return self.log.on_step

    @on_step.setter
    def on_step(self, fn: Any) -> None:
        self.log.on_step = fn

    def _state_hash(self) -> str | None:
        state = self.method.state
        return state.hash() if state is not None else None

    def _on_ban(self, event: BanEvent) -> None:
        self.log.emit(event="ban", step=self.step, **ban_line(event))
        self.reporter.bans(self.aggregator.bans)

    def _alive_record(self, status: PeerStatus | None = None) -> AliveRecord:
        return AliveRecord(
            step=self.step,
            status=status or self.status,
            name=self.name,
            version=self.config_version,  # the majority check of peers without a coordinator reads it
            device=self.device_index,
            # fellow members size target-batch rounds by it, and bound our claims: not before it has
            # settled (the first evaluations of a model are slow)
            rate=self.rate if self._rate_steps >= RATE_WARMUP_STEPS else None,
            microbatch=float(self.method.workers[0].operator.weight),  # the samples of one evaluation
            client=self.node.client_mode,  # never asked to lead, own a part or serve its state
            bans=tuple(self.aggregator.bans.active_peers()),  # the others choose leaders nobody bans
        )

    def _on_view(self, view: AliveView) -> None:
        self.aggregator.matchmaker.alive_peers = view

    def check_config_version(self) -> None:
        """Refuse to train with a config that differs from the swarm's (:class:`ConfigGuard`)."""
        self.guard.check(self.aggregator.matchmaker.alive_peers)

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self, *, max_steps: int | None = None, give_up_after_s: float | None = None) -> int:
        """Train until ``max_steps`` (default: the config's), ``stop_event``, or no progress for
        ``give_up_after_s`` (default: ``Timing.patience_s``). Failed rounds are retried with exponential
        backoff (50 ms up to 2 s). Returns the last committed step.
        """
        patience = give_up_after_s or self.timing.patience_s
        last_progress = time.monotonic()
        target = max_steps if max_steps is not None else self.cfg.max_steps
        self.status = PeerStatus.SYNCING
        self._wait_for_view()
        self.check_config_version()
        self.catchup.sync()
        # Before its first round, every member has this peer in its view: a group whose members all
        # see it leaves the steady state (whose leader stores no announcement) and looks for it
        self.heartbeat.wait_until_seen(self.stop_event, self.timing.view_wait_s)
        self.status = PeerStatus.TRAINING
        while self.step < target and not self.stop_event.is_set():
            try:
                if self.method.state is None:
                    self.method.initialize()
                    _, state_hash = self._report(0, 0.0)  # a joiner may sync to the initial state
                    self.log.emit(event="initialized", step=0, hash=state_hash)
                    last_progress = time.monotonic()  # an initial round under attack may take long
                    continue
                report = self.method.step()
            except RoundFailed as e:
                self._failures_in_row += 1
                logger.info("%s step %d: round failed (%s)", self.name, self.step, e)
                self.log.emit(event="round_failed", step=self.step, reason=str(e))
                if time.monotonic() - last_progress > patience:
                    why = stall_reason(e, self.aggregator.bans, self.cfg)
                    logger.warning("%s: no progress for %.0fs; stopping (%s)", self.name, patience, why)
                    break
                self.check_config_version()
                adopted = False
                if isinstance(e, StateMismatch):  # two groups once committed this step apart
                    adopted = self.catchup.resolve_mismatch(e.peer)
                elif isinstance(e, LeftBehind):  # others may commit it: never redo the step apart
                    adopted = self.catchup.follow(e.peers, e.wait_s, self.stop_event.wait)
                if adopted or self.catchup.sync():
                    last_progress = time.monotonic()
                else:
                    self.stop_event.wait(min(2.0, 0.05 * 2 ** min(self._failures_in_row - 1, 6)))
                continue
            self._failures_in_row = 0
            self.checkpoints.after_step(report.step)  # a peer killed later resumes from here
            last_progress = time.monotonic()
            self._after_step(report.step, report.refreshed)
        self.status = PeerStatus.DONE
        return self.step

    def _after_step(self, step: int, refreshed: bool) -> None:
        """Account the step's samples, publish the progress record, log the step."""
        assert self.method.state is not None
        now = time.monotonic()
        elapsed, self._last_step_time = now - self._last_step_time, now
        batch = int(self.method.last_samples)
        self.samples += batch
        if batch > 0 and self.method.last_compute_s > 0:
            rate = batch / self.method.last_compute_s
            self.rate = rate if self.rate is None else 0.7 * self.rate + 0.3 * rate
            self._rate_steps += 1
        elif batch == 0 and self.rate is not None:  # tagged along: slower than we said
            self.rate *= 0.5
        samples_per_s = batch / elapsed if elapsed > 0 else 0.0
        stats = self.aggregator.stats
        share = self.aggregator.reducer.last_share
        metric, state_hash = self._report(step, samples_per_s)
        self.log.emit(
            step=step,
            samples_per_s=round(samples_per_s, 3),
            hash=state_hash,
            metric=metric,
            group=self.aggregator.last_group_size,
            samples=self.method.last_samples,
            share=round(share, 4),
            members=self.aggregator.last_group.peers if self.aggregator.last_group else [],
            clients=list(self.aggregator.last_group.clients) if self.aggregator.last_group else [],
            refreshed=refreshed,
            bits_up=stats.bits_up,
            bits_down=stats.bits_down,
            wire_sent=stats.wire_bytes_sent,
            wire_received=stats.wire_bytes_received,
        )

    def _report(self, step: int, samples_per_s: float) -> tuple[float, str]:
        """Publish the progress record of a state this peer's group committed (it vouches for that
        state: see :class:`~collab.swarm.state_sync.Vouches`); returns the metric and the state hash."""
        assert self.method.state is not None
        metric = float(self.task.metric(self.method.state.z))
        state_hash = self.method.state.hash()
        self.reporter.progress(
            step=step,
            samples=self.samples,
            samples_per_s=samples_per_s,
            metric=metric,
            metric_name=self.task.metric_name,
            stats=self.aggregator.stats,
            group_size=self.aggregator.last_group_size,
            round_share=self.aggregator.reducer.last_share,
            state_hash=state_hash,
        )
        return metric, state_hash

    def load_checkpoint(self, path: str | Path) -> bool:
        """Start from the checkpoint at ``path`` (before :meth:`run`); ``False`` if there is none.

        Raises :class:`CheckpointError` (one line) and then loads nothing. A loaded state is like a
        downloaded one: :meth:`run` still syncs to peers ahead.
        """
        state = self.checkpoints.load(path)
        if state is None:
            return False
        logger.info("%s: resumed from checkpoint %s at step %d", self.name, path, state.step)
        self.log.emit(event="resumed", step=state.step, hash=state.hash(), path=str(path))
        return True

    def _wait_for_view(self) -> None:
        """Learn who is alive before deciding to sync or initialize (peers that start together meet)."""
        deadline = time.monotonic() + self.timing.view_wait_s
        time.sleep(self.cfg.swarm.heartbeat_interval_s)
        while True:
            self.heartbeat.refresh()
            if time.monotonic() >= deadline or len(self.aggregator.matchmaker.alive_peers) > 1:
                return
            time.sleep(0.1)

    def close(self, linger_s: float = 0.0) -> None:
        """Leave: keep serving ``linger_s`` (late peers may still sync), mark us gone, stop heartbeats."""
        self.checkpoints.save()
        if linger_s > 0:
            time.sleep(linger_s)
        self.heartbeat.stop(last=self._alive_record(PeerStatus.LEFT))
        self.log.emit(event="left", step=self.step)  # the last line of a volunteer that left in order
        self.log.close()


class CoordinatorBeacon:
    """The coordinator's alive record: tells joining peers which config version is the run's."""

    def __init__(self, cfg: RunConfig, node: SwarmNode) -> None:
        record = AliveRecord(
            step=-1, status=PeerStatus.COORDINATOR, name="coordinator", version=cfg.version()
        )
        self._beat = Heartbeat(
            node=node, run_id=cfg.run_id, cfg=cfg.swarm, record=lambda: record, name="collab-beacon"
        )

    def close(self) -> None:
        self._beat.stop()
