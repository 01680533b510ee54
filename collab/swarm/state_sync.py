"""Downloading a peer's replicated state, checked before anyone uses it.

Knows the ``collab.state`` call and :class:`MethodState`; nothing of training. Used by volunteers that
fall behind or join late (``Volunteer.sync``) and by peers that follow a run without training (the model
keeper, ``collab generate --coordinator``). A download is accepted only when the answer names this run's
config version and method and the state's own sha256 equals the hash the peer announced; anything else
is a :class:`StateRejected` with one line that says why, and the caller tries another peer.

**Vouches.** The hash only proves that the bytes are what the source meant to send. A state is adopted
only when more than one member of the run vouches for it (:class:`Vouches`): every volunteer's progress
record, signed with its key, lists the latest (step, state hash) pairs its groups committed, and a
committed group has at least two members, so an honest state is vouched for by the keys of its source and
of a fellow member of the group that made it. A state fewer than two keys vouch for within
``Timing.vouch_wait_s`` is rejected; one whose step other keys vouch for with another hash, and at most
one key for its own, is forged (:class:`ForgedState`: its source is banned). Only when no other peer of
the run is alive (or the run allows groups of one) is the source's word taken alone. A forger that holds
two keys (two tokens of an invite-only run, or two identities of an open one) is not caught this way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from collab.methods.base import MethodState
from collab.swarm.records import AliveRecord, progress_key
from collab.swarm.timing import Timing
from collab.swarm.transport import SwarmNode, TransportError

STATE = "collab.state"
MAX_ASKED_ROUNDS = 16  # group ids a requester may ask about (its failed attempts at one step)


class StateRejected(RuntimeError):
    """A state download failed or its answer did not check out (one line)."""


class ForgedState(StateRejected):
    """Other members vouch for another state at the step the source served: the source lied."""


@dataclass(frozen=True)
class StateSource:
    """What a downloaded state must belong to."""

    config_version: str
    method: str
    timing: Timing


@dataclass(frozen=True)
class Downloaded:
    """A checked state and, of the groups the requester asked about, those whose committed round (in the
    source's lineage) holds the requester's contribution."""

    state: MethodState
    used: frozenset[str] = frozenset()


def asked_rounds(header: Mapping[str, object]) -> list[str]:
    """The group ids a state request asks about (bounded; anything malformed is ignored)."""
    rounds = header.get("rounds")
    if not isinstance(rounds, list):
        return []
    return [r for r in rounds[:MAX_ASKED_ROUNDS] if isinstance(r, str) and len(r) <= 64]


def download_state(
    node: SwarmNode, peer: str, source: StateSource, *, rounds: Sequence[str] = ()
) -> Downloaded:
    """``peer``'s current state, checked against ``source``; raises :class:`StateRejected`.

    ``rounds``: group ids of rounds that failed here after this peer's contribution left; the answer
    says which of them the source's lineage committed with it (see ``Method.adopt_state``)."""
    request = {"rounds": list(rounds[-MAX_ASKED_ROUNDS:])} if rounds else {}
    try:
        header, payload = node.run(
            node.call(peer, STATE, request, timeout_s=source.timing.state_call_s),
            timeout_s=source.timing.state_wait_s,
        )
        state = MethodState.from_bytes(payload)
    except (TransportError, ValueError, TimeoutError) as e:
        raise StateRejected(f"download failed: {e}") from None
    if header.get("version") != source.config_version:
        raise StateRejected("it runs another config")
    if header.get("method") != source.method:
        raise StateRejected(f"it runs method {str(header.get('method'))[:40]!r}, not {source.method!r}")
    if header.get("hash") != state.hash():
        raise StateRejected("its state does not match the hash it announced")
    used = header.get("used")
    asked = set(rounds)
    kept = frozenset(r for r in used if isinstance(r, str) and r in asked) if isinstance(used, list) else None
    return Downloaded(state, kept or frozenset())


def alive_steps(alive: Mapping[str, AliveRecord], *, exclude: str | None = None) -> list[tuple[int, str]]:
    """``(step, peer)`` of the training peers in an alive view, most advanced first."""
    steps = [
        (rec.step, peer) for peer, rec in alive.items() if peer != exclude and rec.trains and rec.step >= 0
    ]
    return sorted(steps, reverse=True)


class Vouches:
    """Checks that more than one member of the run vouches for a state (see the module docstring).

    ``me``: this peer's key (its own records never vouch for what it downloads; default: the node's);
    ``alone_ok``: the run allows groups of one, so a committed state may have no second voucher."""

    def __init__(
        self, node: SwarmNode, run_id: str, timing: Timing, *, me: str | None = None, alone_ok: bool = False
    ):
        self.node, self.key, self.timing, self._me = node, progress_key(run_id), timing, me
        self.alone_ok = alone_ok

    @property
    def me(self) -> str:
        return self._me if self._me is not None else self.node.peer_key

    def check(self, state: MethodState, source: str, alive: Mapping[str, AliveRecord]) -> None:
        """Return once two keys vouch for ``state`` (from ``source``); raise :class:`ForgedState` or
        :class:`StateRejected` when they do not within ``Timing.vouch_wait_s``. ``alive``: the run's alive
        view (with nobody but the source in it, the source's word is taken)."""
        if self.alone_ok or not [p for _, p in alive_steps(alive) if p not in (source, self.me)]:
            return
        step, digest = state.step, state.hash()
        deadline = time.monotonic() + self.timing.vouch_wait_s
        while True:
            support: set[str] = set()
            conflicting: set[str] = set()
            try:
                records = self.node.get_dict(self.key, timeout_s=self.timing.dht_s)
            except Exception:  # a slow DHT: look again until the deadline
                records = {}
            for voucher, record in records.items():  # one signed record per key
                said = _vouched(record, step, exclude=self.me)
                if said == digest:
                    support.add(voucher)
                elif said is not None:
                    conflicting.add(voucher)
            if len(support) >= 2:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(min(self.timing.vouch_poll_s, max(0.0, deadline - time.monotonic())))
        if conflicting:
            raise ForgedState(
                f"it served state {digest[:12]} at step {step}, which {len(support)} key(s) vouch for and "
                f"{len(conflicting)} vouch against"
            )
        raise StateRejected(f"{len(support)} key(s) vouch for its state {digest[:12]} at step {step}, not 2")


def _vouched(record: object, step: int, *, exclude: str) -> str | None:
    """The state hash ``record`` vouches for at ``step`` (``None``: none, or ``exclude``'s record)."""
    if not isinstance(record, dict) or record.get("peer") == exclude:
        return None
    states = record.get("states")
    if not isinstance(states, list):
        return None
    for v in states:
        if isinstance(v, dict) and v.get("step") == step and isinstance(v.get("hash"), str):
            return str(v["hash"])
    return None
