"""Every wait of a peer, derived from the run's swarm settings in one place.

The config names the protocol's own limits (matchmaking, exchange, state download, heartbeats, the round
budget); everything a peer waits for besides - the margins around a call, how long a thread waits for the
event loop, when a device tags along, when a volunteer gives up, how long records live - follows from them
here, so that changing one setting moves every wait that depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from collab.config import SwarmConfig

LOOP_MARGIN_S = 5.0  # a thread waiting on the event loop allows this much beyond the call's own limit
UPLOAD_MARGIN_S = 2.0  # a part call allows this for the upload on top of the owner's wait
DHT_S = 10.0  # one DHT read or write
PRUNE_EVERY_S = 1.0  # how often round bookkeeping past its horizon is dropped (a scan of all of it)
# A member moves about 4x its message in a round: its parts out and the aggregate in, and as an owner the
# others' parts in and its part of the aggregate out.
EXCHANGE_TRAFFIC = 4.0


@dataclass(frozen=True)
class Timing:
    """The derived waits (seconds). Build with :meth:`of`."""

    matchmaking_s: float  # forming a group
    matchmaking_wait_s: float  # a thread waiting for matchmaking to answer
    announce_ttl_s: float  # a round announcement's life in the DHT
    steady_announce_s: float  # a steady-state leader whose group has not filled by then announces the round
    matchmaking_horizon_s: float  # matchmaking bookkeeping older than this is dropped
    allreduce_s: float  # an owner waiting for the parts of its round
    part_call_s: float  # a member's part call (the owner's wait plus the upload)
    reduce_wait_s: float  # a thread waiting for the exchange to answer
    slot_horizon_s: float  # exchange bookkeeping older than this is dropped
    state_call_s: float  # a state download
    state_wait_s: float  # a thread waiting for the download
    vouch_wait_s: float  # how long a downloaded state may wait for another member to vouch for it
    vouch_poll_s: float  # how often the vouches are read meanwhile
    unconfirmed_s: float  # after a confirmation went unanswered: how long to look for members that committed
    left_out_s: float  # left out of a forming group: how long to look for its members moving ahead
    dht_s: float  # one DHT read or write
    view_wait_s: float  # at the start: how long to look for other peers before deciding to initialize
    tag_along_s: float | None  # past this, a device without a finished microbatch tags along (weight 0)
    patience_s: float  # a volunteer without progress for this long stops
    suspect_s: float  # a peer whose state did not check out is skipped this long (keeper)
    progress_ttl_s: float  # a progress record's life in the DHT
    progress_every_s: float  # a peer stores its progress record at most this often (the latest one)
    bans_republish_s: float  # a peer's ban report is stored again this often while it holds bans
    stall_s: float  # a whole run (demo) without a new step for this long has stalled
    bandwidth_b_s: float  # the slowest link (bytes/s) the exchange's waits allow for

    def transfer_s(self, message_bytes: int, measured_b_s: float | None = None) -> float:
        """How long a round's traffic takes when one member's message is ``message_bytes`` long, at the
        configured slowest link or at ``measured_b_s`` (this peer's measured rate) when that is slower."""
        rate = self.bandwidth_b_s if measured_b_s is None else min(self.bandwidth_b_s, measured_b_s)
        return EXCHANGE_TRAFFIC * max(0, message_bytes) / max(rate, 1.0)

    def for_payload(self, message_bytes: int, measured_b_s: float | None = None) -> Timing:
        """The exchange's waits for a round of ``message_bytes`` per member: each grows by
        :meth:`transfer_s`, so a dense refresh round of a large model gets the time its bytes need (a
        retry of a round that failed on time alone would fail the same way: MASHA's refresh coin is
        the same on every retry)."""
        extra = self.transfer_s(message_bytes, measured_b_s)
        if extra <= 0:
            return self
        return replace(
            self,
            allreduce_s=self.allreduce_s + extra,
            part_call_s=self.part_call_s + extra,
            reduce_wait_s=self.reduce_wait_s + extra,
            slot_horizon_s=self.slot_horizon_s + 4 * extra,
        )

    @classmethod
    def of(cls, sw: SwarmConfig) -> Timing:
        exchange = sw.matchmaking_timeout_s + sw.allreduce_timeout_s
        # A member slower than the round budget still contributes one microbatch if it ends within one
        # more budget (never beyond half of the exchange limit the others wait under); past that it tags
        # along, so the others' round is never held up for long.
        tag_along = (
            None
            if sw.round_time_s is None
            else sw.round_time_s + min(sw.round_time_s, sw.allreduce_timeout_s / 2)
        )
        return cls(
            matchmaking_s=sw.matchmaking_timeout_s,
            matchmaking_wait_s=sw.matchmaking_timeout_s + LOOP_MARGIN_S,
            announce_ttl_s=2 * sw.matchmaking_timeout_s,
            # a steady group fills within a few ms; by this, a member may be about to look the usual way
            steady_announce_s=min(0.05, sw.min_matchmaking_time_s / 4),
            matchmaking_horizon_s=4 * sw.matchmaking_timeout_s,
            allreduce_s=sw.allreduce_timeout_s,
            part_call_s=sw.allreduce_timeout_s + UPLOAD_MARGIN_S,
            # the exchange, then the confirmation (each at most a part call)
            reduce_wait_s=2 * (sw.allreduce_timeout_s + UPLOAD_MARGIN_S) + LOOP_MARGIN_S,
            slot_horizon_s=4 * sw.allreduce_timeout_s,
            state_call_s=sw.state_sync_timeout_s,
            state_wait_s=sw.state_sync_timeout_s + LOOP_MARGIN_S,
            # a fellow member publishes its vouch right after the commit; allow for a few slow stores
            vouch_wait_s=2 * sw.heartbeat_ttl_s,
            vouch_poll_s=sw.heartbeat_interval_s / 2,
            # the others' confirmations resolve within a part call; their alive records follow a beat later
            unconfirmed_s=sw.allreduce_timeout_s + UPLOAD_MARGIN_S + 2 * sw.heartbeat_interval_s,
            left_out_s=sw.matchmaking_timeout_s
            + sw.allreduce_timeout_s
            + UPLOAD_MARGIN_S
            + 2 * sw.heartbeat_interval_s,
            dht_s=DHT_S,
            view_wait_s=3 * sw.heartbeat_interval_s,
            tag_along_s=tag_along,
            patience_s=6 * exchange,
            suspect_s=10 * sw.heartbeat_ttl_s,
            progress_ttl_s=max(30.0, 10 * sw.heartbeat_ttl_s),
            # a signed DHT store per step cost small models' volunteers half their CPU; the records' last
            # VOUCHED_STATES vouches and the vouch wait (2 heartbeat TTLs) allow for a short delay
            progress_every_s=sw.heartbeat_interval_s / 2,
            bans_republish_s=sw.heartbeat_ttl_s,
            stall_s=10 * exchange,
            bandwidth_b_s=sw.min_bandwidth_mb_s * 1e6,
        )
