"""The checkpoint file: round trip, atomic write, and every kind of damage reported in one line.

Any single flipped byte and any truncation is refused with a CheckpointError (never another exception,
never a silently different state); another config version or method is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collab.methods.base import MethodState
from collab.methods.checkpoint import (
    MAGIC,
    CheckpointError,
    decode_checkpoint,
    encode_checkpoint,
    read_checkpoint,
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
