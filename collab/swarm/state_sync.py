"""Downloading a peer's replicated state, checked before anyone uses it.

Knows the ``collab.state`` call and :class:`MethodState`; nothing of training. Used by volunteers that
fall behind or join late (``Volunteer.sync``) and by peers that follow a run without training (the model
keeper, ``collab generate --coordinator``). A download is accepted only when the answer names this run's
config version and method and the state's own sha256 equals the hash the peer announced; anything else
is a :class:`StateRejected` with one line that says why, and the caller tries another peer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from collab.methods.base import MethodState
from collab.swarm.records import PeerStatus
from collab.swarm.timing import Timing
from collab.swarm.transport import SwarmNode, TransportError

STATE = "collab.state"
MAX_ASKED_ROUNDS = 16  # group ids a requester may ask about (its failed attempts at one step)


class StateRejected(RuntimeError):
    """A state download failed or its answer did not check out (one line)."""


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


def alive_steps(alive: Mapping[str, object], *, exclude: str | None = None) -> list[tuple[int, str]]:
    """``(step, peer)`` of the training peers in an alive view, most advanced first."""
    out = []
    for peer, rec in alive.items():
        if (
            peer == exclude
            or not isinstance(rec, dict)
            or rec.get("status") in (PeerStatus.COORDINATOR, PeerStatus.LEFT)
        ):
            continue
        step = rec.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            out.append((step, peer))
    return sorted(out, reverse=True)
