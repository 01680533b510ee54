"""The config guard: a peer never trains with a config other than the run's."""

from __future__ import annotations

from collections.abc import Mapping

from collab.swarm.records import AliveRecord, PeerStatus


class ConfigMismatch(RuntimeError):
    """This peer's run config is not the one the swarm runs."""


class ConfigGuard:
    """``ConfigGuard(me, version).check(alive_view)`` raises :class:`ConfigMismatch` when the run's config
    is another one. The coordinator's alive record, when there is one, says which config is the run's;
    without a coordinator the majority of the alive peers, this one included, does (a tie keeps this peer
    running)."""

    def __init__(self, me: str, version: str) -> None:
        self.me, self.version = me, version

    def check(self, alive: Mapping[str, AliveRecord]) -> None:
        versions = [(rec.version, rec.status) for p, rec in alive.items() if p != self.me and rec.version]
        coordinator = [v for v, status in versions if status == PeerStatus.COORDINATOR]
        others = [v for v, status in versions if status != PeerStatus.COORDINATOR]
        if coordinator:
            swarm_version = coordinator[0]
            wrong = swarm_version != self.version
        else:
            differing = [v for v in others if v != self.version]
            swarm_version = differing[0] if differing else self.version
            wrong = len(differing) > len(others) - len(differing) + 1  # this peer counts too
        if wrong:
            raise ConfigMismatch(
                f"this peer's config (version {self.version}) differs from the swarm's (version "
                f"{swarm_version}): use the run's config (collab join --coordinator URL fetches it)"
            )
