"""A volunteer that stops for want of progress says why: the last round's failure and whom it bans, and
that a run whose groups need every volunteer cannot go on while one of them is banned."""

from __future__ import annotations

from collab.config import RunConfig, parse_config
from collab.methods.base import RoundFailed
from collab.swarm.bans import Bans
from collab.swarm.volunteer import stall_reason


def _cfg(min_group_size: int) -> RunConfig:
    return parse_config(
        {"num_devices": 3, "method": {"gamma": 0.1}, "swarm": {"min_group_size": min_group_size}}
    )


def test_a_stall_names_the_last_failure_and_the_bans() -> None:
    bans = Bans(duration_s=600.0, me="me")
    last = RoundFailed("round 709.delta: only 1/2 peer(s), need 3")
    assert stall_reason(last, bans, _cfg(3)) == f"last round: {last}"
    bans.ban("12D3KooWpeerABCDEF", "norm 1e+06 is over 100x the group's median 0.05", "709.delta")
    full = stall_reason(last, bans, _cfg(3))
    assert "only 1/2 peer(s)" in full and "ABCDEF (norm 1e+06" in full
    assert full.endswith("min_group_size 3 needs every volunteer")
    assert "needs every volunteer" not in stall_reason(last, bans, _cfg(2))
