"""A small round's only owner answers with its account: what every member checks in it.

``parse_stats`` reads the account off the wire (canonical member indices only, finite numbers);
``account_error`` is each member's verdict: its own entry vouched for, every entry within what an honest
owner lets in (the owner's own included), and the aggregate's norm within the account's weighted mean of
norms. Honest accounts - a fast owner within its published device bound among them - always pass.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from collab.config import SwarmConfig
from collab.swarm.allreduce import account_error, parse_stats

CFG = SwarmConfig()  # max_norm_ratio 10, max_weight_ratio 100


@pytest.mark.parametrize(
    "raw",
    [
        {"00": [1.0, 1.0]},  # an alias of member 0
        {"٣": [1.0, 1.0]},  # a non-ASCII digit
        {"²": [1.0, 1.0]},
        {"3": [1.0, 1.0]},  # not a member of a group of 3
        {"0": [True, 1.0]},
        {"0": [1.0, math.nan]},
        {"0": [0.0, 1.0]},  # counted with no samples
        {"0": [1.0, -1.0]},
        {"0": [10**400, 1.0]},  # too large for a float
        {"0": [1.0]},
        {},
        [["0", [1.0, 1.0]]],
    ],
)
def test_malformed_accounts_are_refused(raw: Any) -> None:
    assert parse_stats(raw, 3) is None


def test_a_canonical_account_is_read() -> None:
    assert parse_stats({"0": [2, 1.5], "2": [1.0, 0.25]}, 3) == {"0": [2.0, 1.5], "2": [1.0, 0.25]}


def _verdict(stats: dict[str, list[float]], norm: float, **kw: Any) -> str | None:
    args: dict[str, Any] = {
        "me": 1,
        "weight": 2.0,
        "counted": True,
        "own_norm": 3.0,
        "owner": 0,
        "excluded": set(),
        "bounds": {},
        "cfg": CFG,
    }
    return account_error(stats, norm, **{**args, **kw})


HONEST = {"0": [1.0, 2.0], "1": [2.0, 3.0], "2": [1.0, 4.0]}  # weighted mean of norms: 3.0


def test_an_honest_account_passes() -> None:
    assert _verdict(HONEST, 2.9) is None
    assert _verdict(HONEST, 3.0) is None


def test_an_aggregate_longer_than_the_account_allows_fails() -> None:
    assert "over the" in (_verdict(HONEST, 3.1) or "")


def test_this_members_entry_must_be_what_it_sent() -> None:
    assert "norm in the account" in (_verdict(HONEST, 2.9, own_norm=1.0) or "")
    assert "weight in the account" in (_verdict(HONEST, 2.9, weight=4.0) or "")  # under-weighted
    assert "weight in the account" in (_verdict(HONEST, 2.9, weight=1.0) or "")  # over-weighted
    # a claim near the member's published bound may be capped by the owner
    assert _verdict(HONEST, 2.9, weight=4.0, bounds={1: 2.0}) is None
    assert "missing" in (_verdict({"0": [1.0, 2.0]}, 1.0) or "")


def test_an_entry_for_a_member_not_counted_fails() -> None:
    assert "not counted" in (_verdict(HONEST, 2.9, counted=False) or "")  # e.g. a member tagging along
    assert "dropped" in (_verdict(HONEST, 2.9, me=2, own_norm=4.0, weight=1.0, excluded={1}) or "")


def test_a_made_up_entry_cannot_widen_the_bound() -> None:
    # the owner files a huge contribution under member 2, which tags along (weight 0) and has no entry
    made_up = {"0": [1.0, 2.0], "1": [2.0, 3.0], "2": [1e12, 1e12]}
    assert _verdict(made_up, 1e11) is not None
    assert "not counted" in (_verdict(made_up, 1e11, me=2, counted=False, weight=0.0) or "")


def test_the_owners_own_entry_is_held_to_the_group() -> None:
    big_norm = {"0": [1.0, 2000.0], "1": [2.0, 3.0], "2": [1.0, 4.0]}
    assert "the owner's own contribution's norm" in (_verdict(big_norm, 30.0) or "")
    big_weight = {"0": [1e6, 2.0], "1": [2.0, 3.0], "2": [1.0, 4.0]}
    assert "the owner's own weight" in (_verdict(big_weight, 2.0) or "")
    assert "the owner's own weight" in (_verdict(big_weight, 2.0, bounds={0: 1e3}) or "")


def test_an_honest_fast_owner_within_its_published_bound_passes() -> None:
    fast = {"0": [1000.0, 2.0], "1": [2.0, 3.0], "2": [1.0, 4.0]}  # 500x the others' samples
    assert _verdict(fast, 2.0, bounds={0: 1200.0, 1: 10.0, 2: 10.0}) is None
