"""SwarmAggregator: the :class:`~collab.methods.base.Aggregator` of a real peer.

One local device per process. A round is: form the group of ``(step, phase)`` (matchmaking), exact
reduce among its members, then the method's deterministic server step. Any failure - a peer lost, a
timeout, a malformed part - raises :class:`~collab.methods.base.RoundFailed`; the method then leaves its
state untouched and the step is redone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from collab.compression import CompressedMessage
from collab.compression.partition import Layout, round_layout
from collab.config import SwarmConfig
from collab.methods.base import Aggregator, CommStats, Contribution, RoundFailed, RoundKey, ServerFn
from collab.swarm.agreement import Unconfirmed
from collab.swarm.allreduce import ExactReducer, PeerUnreachable, message_size
from collab.swarm.bans import BanEvent, Bans
from collab.swarm.budget import ClaimBounds
from collab.swarm.matchmaking import Group, Matchmaker
from collab.swarm.timing import Timing
from collab.swarm.transport import SwarmNode

logger = logging.getLogger(__name__)

COMMITTED_HISTORY = 256  # committed groups remembered (a few minutes of rounds)


class SwarmAggregator(Aggregator):
    """``SwarmAggregator(node=..., run_id=..., cfg=..., device_index=m, shared_seed=run_seed)``."""

    def __init__(
        self,
        *,
        node: SwarmNode,
        run_id: str,
        cfg: SwarmConfig,
        device_index: int,
        shared_seed: int,
        config_version: str = "",
        bans: Bans | None = None,
        state_hash: Callable[[], str | None] = lambda: None,
        on_ban: Callable[[BanEvent], None] | None = None,
    ) -> None:
        self.node, self.cfg, self.shared_seed = node, cfg, shared_seed
        self.timing = Timing.of(cfg)
        self.stats = CommStats()
        self.bans = bans or Bans(duration_s=cfg.ban_duration_s, me=node.peer_key, on_ban=on_ban)
        self.matchmaker = Matchmaker(
            node=node,
            run_id=run_id,
            cfg=cfg,
            device_index=device_index,
            config_version=config_version,
            bans=self.bans,
            state_hash=state_hash,
        )
        self.reducer = ExactReducer(
            node=node,
            cfg=cfg,
            bans=self.bans,
            claims=ClaimBounds(cfg, alive=lambda: self.matchmaker.alive_peers),
        )
        self._last_group: Group | None = None
        self._prepared: tuple[str, Group] | None = None  # (round id, group) formed before computing
        self.last_attempt: str | None = None
        # committed groups of this peer's lineage, newest last: group id -> members whose contributions
        # the aggregate holds (a member whose round failed locally asks, when it syncs, whether it was one)
        self.committed: OrderedDict[str, frozenset[str]] = OrderedDict()

    @property
    def num_local(self) -> int:
        return 1

    @property
    def last_group_size(self) -> int:
        return len(self._last_group) if self._last_group is not None else 0

    @property
    def last_group(self) -> Group | None:
        return self._last_group

    def prepared_members(self) -> list[str]:
        """The members of the group formed for the round being computed (empty if none was)."""
        return self._prepared[1].peers if self._prepared is not None else []

    def contributed(self, group_id: str, peer: str) -> bool:
        """Whether this peer's lineage holds a committed round of group ``group_id`` with ``peer``'s
        contribution in it."""
        return peer in self.committed.get(group_id, frozenset())

    def _layout(self, msg: CompressedMessage) -> Layout:
        return round_layout(msg, self.shared_seed)

    def _form_group(self, round_id: str) -> Group:
        try:
            return self.node.run(
                self.matchmaker.form_group(round_id), timeout_s=self.timing.matchmaking_wait_s
            )
        except TimeoutError:
            raise RoundFailed(f"round {round_id}: matchmaking timed out") from None

    def prepare(self, key: RoundKey) -> None:
        """With a round budget (``round_time_s``), form the group before computing: members then compute
        for the same budget from about the same moment, and a slow member is never late for matchmaking."""
        self._prepared = None
        if self.cfg.round_time_s is None:
            return
        round_id = f"{key.step}.{key.phase}"
        sent0, recv0 = self.node.bytes_sent, self.node.bytes_received
        try:
            self._prepared = (round_id, self._form_group(round_id))
        except RoundFailed:
            raise
        except Exception as e:  # as in reduce: a broken peer's answer skips the round, never kills us
            raise RoundFailed(f"round {round_id}: {type(e).__name__}: {e}") from None
        finally:
            self._count_wire(sent0, recv0)
            if self._prepared is None:
                self.matchmaker.remember_group([])  # the next round looks for its group the usual way

    def _count_wire(self, sent0: int, recv0: int) -> None:
        self.stats.wire_bytes_sent += self.node.bytes_sent - sent0
        self.stats.wire_bytes_received += self.node.bytes_received - recv0

    def reduce(
        self, key: RoundKey, contributions: Sequence[Contribution], server: ServerFn
    ) -> CompressedMessage:
        if len(contributions) != 1:
            raise ValueError("a swarm peer contributes for exactly one device")
        c = contributions[0]
        round_id = f"{key.step}.{key.phase}"
        sent0, recv0 = self.node.bytes_sent, self.node.bytes_received
        prepared, self._prepared = self._prepared, None
        self.last_attempt = None
        mean: CompressedMessage | None = None
        try:
            group = prepared[1] if prepared and prepared[0] == round_id else self._form_group(round_id)
            self.last_attempt = group.group_id  # from here on our contribution may reach the owners
            mean = self.node.run(
                self.reducer.reduce(group, c.message, c.weight, self._layout(c.message)),
                timeout_s=self.timing.for_payload(
                    message_size(c.message), self.reducer.link_b_s
                ).reduce_wait_s,
            )
        except PeerUnreachable as e:
            self.matchmaker.suspect(e.peer)
            raise
        except TimeoutError:
            # past the exchange's whole limit, the confirmation included: the others may have committed
            # the round with this peer's parts, so never redo it apart (see LeftBehind)
            others = [p for p in group.peers if p != self.node.peer_key]
            raise Unconfirmed(
                f"round {round_id} timed out; its other members may have committed it",
                others,
                self.timing.unconfirmed_s,
            ) from None
        except RoundFailed:
            raise
        except Exception as e:  # hostile or broken peers' answers must not kill this peer: skip the round
            logger.warning("round %s failed unexpectedly: %s: %s", round_id, type(e).__name__, e)
            raise RoundFailed(f"round {round_id}: {type(e).__name__}: {e}") from None
        finally:
            self._count_wire(sent0, recv0)
            if mean is None:
                self.matchmaker.remember_group([])  # the next round looks for its group the usual way
        out = server(mean)
        self.stats.bits_up += c.message.bits
        self.stats.bits_down += out.bits
        self.stats.rounds += 1
        self._last_group = group
        excluded = self.reducer.last_excluded
        members = frozenset(p for p in group.peers if p not in excluded)
        self.committed[group.group_id] = members
        self.matchmaker.remember_group(members, group.clients)
        while len(self.committed) > COMMITTED_HISTORY:
            self.committed.popitem(last=False)
        logger.debug("%s round %s: group of %d", self.node.peer_key[-6:], round_id, len(group))
        return out
