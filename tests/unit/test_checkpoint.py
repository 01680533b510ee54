"""The checkpoint file: round trip, atomic write, and every kind of damage reported in one line.

Any single flipped byte and any truncation is refused with a CheckpointError (never another exception,
never a silently different state); another config version or method is refused by name. The optional
run config in the header comes back as written, must hash to the saved config version, and files
without it load as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collab.config import parse_config
from collab.methods.base import MAX_STREAMED_HEADER_BYTES, MethodState, StreamHash
from collab.methods.checkpoint import (
    MAGIC,
    CheckpointError,
    decode_checkpoint,
    encode_checkpoint,
    open_checkpoint,
    parse_checkpoint,
    read_checkpoint,
    read_checkpoint_config,
    write_checkpoint,
)

VERSION, METHOD = "0123456789abcdef", "masha1"


def _state(step: int = 7, dim: int = 6) -> MethodState:
    g = torch.Generator().manual_seed(step)
    z, w, fw = (torch.randn(dim, generator=g) for _ in range(3))
    return MethodState(step=step, z=z, w=w, fw=fw, server_error=torch.zeros(dim))


DATA = encode_checkpoint(_state(), config_version=VERSION, method=METHOD)


def _decode(data: bytes, **kw: str) -> MethodState:
    return decode_checkpoint(
        data, config_version=kw.get("version", VERSION), method=kw.get("method", METHOD), name="ck"
    )


def test_round_trip_and_atomic_write(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "peer.ckpt"
    assert read_checkpoint(path, config_version=VERSION, method=METHOD) is None, "no file: nothing to load"
    write_checkpoint(path, DATA)
    loaded = read_checkpoint(path, config_version=VERSION, method=METHOD)
    assert loaded is not None and loaded.hash() == _state().hash() and loaded.step == 7
    assert DATA.startswith(MAGIC)
    newer = encode_checkpoint(_state(step=8), config_version=VERSION, method=METHOD)
    write_checkpoint(path, newer)
    assert path.read_bytes() == newer and sorted(p.name for p in path.parent.iterdir()) == ["peer.ckpt"]


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"", "corrupt (truncated)"),
        (DATA[:5], "corrupt (truncated)"),
        (DATA[:30], "corrupt (truncated)"),
        (DATA[:-1], "corrupt (truncated)"),
        (DATA + b"\x00", "corrupt (trailing bytes)"),
        (DATA[:-1] + bytes([DATA[-1] ^ 1]), "corrupt (hash mismatch)"),
        (b"\x00" * 200, "corrupt (not a collab checkpoint)"),
        (_state().to_bytes(), "corrupt (not a collab checkpoint)"),  # the old, headerless format
        (MAGIC + b"\x09" + DATA[9:], "format version 9"),
    ],
)
def test_damage_is_one_clear_line(data: bytes, reason: str) -> None:
    with pytest.raises(CheckpointError) as e:
        _decode(data)
    msg = str(e.value)
    assert msg.startswith("checkpoint ck ") and reason in msg and msg.endswith("not loaded"), msg
    assert "\n" not in msg


def test_another_config_or_method_is_refused_by_name() -> None:
    with pytest.raises(CheckpointError, match="another run config"):
        _decode(DATA, version="fedcba9876543210")
    with pytest.raises(CheckpointError, match="written by method masha1, this run uses masha2"):
        _decode(DATA, method="masha2")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(0, len(DATA) - 1), st.integers(1, 255))
def test_any_flipped_byte_is_detected(at: int, xor: int) -> None:
    damaged = bytearray(DATA)
    damaged[at] ^= xor
    with pytest.raises(CheckpointError):
        _decode(bytes(damaged))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(0, len(DATA) - 1))
def test_any_truncation_is_detected(n: int) -> None:
    with pytest.raises(CheckpointError):
        _decode(DATA[:n])


def test_unreadable_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        read_checkpoint(tmp_path, config_version=VERSION, method=METHOD)  # a folder, not a file


# ---- the run config in the header (optional; `collab export` reads it) ------------------------------
CFG = parse_config({"run_id": "ck", "task": {"name": "bilinear", "dim": 3}, "method": {"gamma": 0.1}})
OTHER = parse_config({"run_id": "ck", "task": {"name": "bilinear", "dim": 4}, "method": {"gamma": 0.1}})
WITH_CONFIG = encode_checkpoint(_state(), config_version=CFG.version(), method=METHOD, config=CFG)


def _with_header(data: bytes, drop: str = "", **changes: object) -> bytes:
    """``data`` with header fields replaced or dropped (the sha256 kept: it does not cover ``config``)."""
    n = int.from_bytes(data[9:13], "little")
    header = {**json.loads(data[13 : 13 + n]), **changes}
    header.pop(drop, None)
    head = json.dumps(header, sort_keys=True).encode()
    return data[:9] + len(head).to_bytes(4, "little") + head + data[13 + n :]


def test_the_run_config_travels_in_the_header(tmp_path: Path) -> None:
    path = tmp_path / "peer.ckpt"
    write_checkpoint(path, WITH_CONFIG)
    assert read_checkpoint_config(path) == CFG
    ck = open_checkpoint(path)
    assert (ck.config, ck.config_version, ck.method) == (CFG, CFG.version(), METHOD)
    assert ck.state.hash() == _state().hash()
    loaded = read_checkpoint(path, config_version=CFG.version(), method=METHOD)
    assert loaded is not None and loaded.hash() == _state().hash()
    with pytest.raises(CheckpointError, match="another run config"):
        read_checkpoint(path, config_version=OTHER.version(), method=METHOD)


def test_a_checkpoint_without_config_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "old.ckpt"
    write_checkpoint(path, DATA)  # as written before the field existed
    assert read_checkpoint_config(path) is None and open_checkpoint(path).config is None
    # The sha256 is what it always was: without `config`, a new file is exactly an old one (and a reader
    # that ignores the field reads the new files too).
    old_style = _with_header(WITH_CONFIG, drop="config")
    assert old_style == encode_checkpoint(_state(), config_version=CFG.version(), method=METHOD)
    assert _decode(old_style, version=CFG.version()).hash() == _state().hash()


def test_missing_file_is_one_line_for_open(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"^checkpoint \S+nope.ckpt does not exist; not loaded$"):
        open_checkpoint(tmp_path / "nope.ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint_config(tmp_path / "nope.ckpt")


@pytest.mark.parametrize(
    "config,reason",
    [
        (OTHER.model_dump(mode="json"), "its embedded config does not match its config version"),
        ({"method": {"gamma": -1}}, "its embedded config is not a valid run config"),
        ("not a mapping", "its embedded config is not a valid run config"),
        (None, "its embedded config is not a valid run config"),
    ],
)
def test_an_embedded_config_that_does_not_fit_is_corruption(config: object, reason: str) -> None:
    with pytest.raises(CheckpointError) as e:
        _decode(_with_header(WITH_CONFIG, config=config), version=CFG.version())
    assert str(e.value) == f"checkpoint ck is corrupt ({reason}); not loaded"


def test_encode_refuses_a_config_of_another_version() -> None:
    with pytest.raises(ValueError, match="config version"):
        encode_checkpoint(_state(), config_version=VERSION, method=METHOD, config=CFG)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(0, len(WITH_CONFIG) - 1), st.integers(1, 255))
def test_a_flipped_byte_never_yields_another_state_or_config(at: int, xor: int) -> None:
    """Outside the sha256, the config is checked by its version: a flipped byte is refused, or (in the
    key's name only) leaves the state and no config: never another state or another config."""
    damaged = bytearray(WITH_CONFIG)
    damaged[at] ^= xor
    try:
        ck = parse_checkpoint(bytes(damaged), name="ck")
    except CheckpointError:
        return
    assert ck.state.hash() == _state().hash() and ck.config_version == CFG.version()
    assert ck.config in (CFG, None)


def test_a_state_is_hashed_once_until_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    state = MethodState(step=3, z=torch.arange(6.0), w=torch.zeros(6), fw=torch.ones(6))
    calls: list[int] = []
    honest = MethodState._digest

    def counted(self: MethodState) -> str:
        calls.append(self.step)
        return honest(self)

    monkeypatch.setattr(MethodState, "_digest", counted)
    first = state.hash()
    assert state.hash() == first and state.to_bytes() and len(calls) == 1, "asked three times, hashed once"
    state.z.add_(1.0)  # an in-place write
    changed = state.hash()
    assert changed != first and len(calls) == 2
    state.z.sub_(1.0)
    assert state.hash() == first, "the same bytes hash the same"
    state.extra["m"] = torch.zeros(2)  # another tensor
    assert state.hash() != first
    state.w = torch.ones(6)  # another object
    state.step = 4
    assert state.hash() == honest(state) and len(calls) == 5
    loaded = MethodState.from_bytes(state.to_bytes())  # from_bytes checks the hash: kept on the copy
    assert loaded.hash() == state.hash() and len(calls) == 6


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=0, max_size=3),
    dim=st.integers(0, 30),
    cuts=st.lists(st.integers(1, 200), min_size=1, max_size=12),
)
def test_a_state_hashed_as_it_arrives_in_pieces_hashes_as_a_whole(
    sizes: list[int], dim: int, cuts: list[int]
) -> None:
    """A download hashes the serialization chunk by chunk (StreamHash): however the bytes are cut, the
    digest is the state's own hash, and from_bytes takes it without hashing the state again."""
    g = torch.Generator().manual_seed(dim)
    extra = {f"m{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    state = MethodState(
        step=dim, z=torch.randn(dim, generator=g), w=torch.zeros(dim), fw=torch.ones(dim), extra=extra
    )
    blob = state.to_bytes()
    streamed, at, i = StreamHash(), 0, 0
    while at < len(blob):
        cut = cuts[i % len(cuts)]
        streamed.update(blob[at : at + cut])
        at, i = at + cut, i + 1
    assert streamed.digest(len(blob)) == state.hash()
    assert streamed.digest(len(blob) + 1) is None, "not all the bytes: no digest"
    loaded = MethodState.from_bytes(bytearray(blob), streamed=streamed)
    assert loaded.hash() == state.hash() and torch.equal(loaded.z, state.z)


def test_a_streamed_hash_of_other_bytes_is_never_taken() -> None:
    """A stream fed other bytes than the ones parsed gives another digest: from_bytes refuses the state
    (its header's hash does not match), and a layout to_bytes never writes gets no digest at all."""
    state = _state()
    blob = state.to_bytes()
    wrong = StreamHash()
    wrong.update(blob[:-4] + b"\0\0\0\0")
    with pytest.raises(ValueError, match="hash mismatch"):
        MethodState.from_bytes(bytearray(blob), streamed=wrong)
    head = json.dumps(
        {"version": 1, "step": 1, "tensors": [["z", 1], ["fw", 1], ["w", 1]], "hash": ""}
    ).encode()
    unsorted = StreamHash()
    unsorted.update(len(head).to_bytes(4, "little") + head + bytes(12))
    assert unsorted.digest(4 + len(head) + 12) is None


@pytest.mark.parametrize(
    "head",
    [
        b'{"version": 1, "step": 1e999, "tensors": [["fw", 1], ["w", 1], ["z", 1]], "hash": ""}',
        b'{"step": 1, "tensors": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"version": 1, "step": 1, "tensors": [["fw", 1], ["w", 1], ["z", 1], ["\\ud800", 1]], "hash": ""}',
        b'{"version": 1, "step": 1, "tensors": [["fw", 1], ["w", -1], ["z", 1]], "hash": ""}',
        b"not json at all",
    ],
    ids=["huge step", "deep nesting", "lone surrogate", "negative count", "not json"],
)
def test_a_hostile_header_gets_no_streamed_digest_and_one_clear_error(head: bytes) -> None:
    """Whatever a state server puts in the header, the stream hash gives no digest and parses it once
    (never raises, never re-reads it per piece), and from_bytes refuses the bytes with a ValueError."""
    blob = len(head).to_bytes(4, "little") + head + bytes(16)
    streamed = StreamHash()
    for at in range(0, len(blob), 4096):
        streamed.update(blob[at : at + 4096])
    assert streamed.digest(len(blob)) is None
    with pytest.raises(ValueError, match="malformed method state"):
        MethodState.from_bytes(bytearray(blob), streamed=streamed)


def test_a_header_longer_than_the_cap_is_not_buffered() -> None:
    streamed = StreamHash()
    streamed.update((MAX_STREAMED_HEADER_BYTES + 1).to_bytes(4, "little") + b"{" * 1000)
    streamed.update(b" " * 10_000)
    assert streamed.digest(4 + 1000 + 10_000) is None
