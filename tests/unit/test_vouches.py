"""The states a progress record vouches for: one compact string, read back exactly, never misread."""

from __future__ import annotations

import pytest

from collab.swarm.records import MAX_VOUCH_CHARS, VOUCHED_STATES, ProgressRecord, vouched_hash, vouches_text


def _record(states: str) -> ProgressRecord:
    return ProgressRecord(
        step=1, samples=1, samples_per_s=1.0, metric=0.0, metric_name="loss", bits_up=0.0, bits_down=0.0,
        wire_sent=0, wire_received=0, group_size=1, round_share=1.0, device="cpu", client_mode=False,
        software_version="0", config_version="v", name="n", time=0.0, peer="p", states=states,
    )  # fmt: skip


def test_vouches_read_back_exactly() -> None:
    states = [(s, f"{s:032x}") for s in range(1000, 1000 + VOUCHED_STATES)]
    text = vouches_text(states)
    for step, digest in states:
        assert vouched_hash(text, step) == digest
    assert vouched_hash(text, 999) is None and vouched_hash(text, 1000 + VOUCHED_STATES) is None
    assert vouched_hash(vouches_text([(11, "b"), (1, "a")]), 1) == "a"  # "11" is not step 1
    assert _record(text).states == text


def test_the_longest_vouches_fit_the_record_and_longer_ones_do_not() -> None:
    longest = vouches_text([(10**20 - 1 - i, "f" * 64) for i in range(VOUCHED_STATES)])
    assert len(longest) < VOUCHED_STATES * MAX_VOUCH_CHARS
    assert _record(longest).states == longest
    with pytest.raises(ValueError):
        _record(longest + " " + "x" * MAX_VOUCH_CHARS)


@pytest.mark.parametrize("text", [None, 5, ["1:a"], "", "1", "1:", ":a", "x:1", "1:" + "a" * 65, "1;a 2:b"])
def test_malformed_vouches_vouch_for_nothing(text: object) -> None:
    assert vouched_hash(text, 1) is None
