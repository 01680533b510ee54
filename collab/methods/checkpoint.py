"""The local checkpoint file: a method state plus what it belongs to, written atomically, checked on load.

Knows :class:`MethodState` and files; nothing of the swarm. Format (version 1)::

    b"COLLABCK" | u8 format version | u32 header length | JSON header | MethodState.to_bytes()

The header holds ``config_version``, ``method``, ``step``, ``size`` and a ``sha256`` over those fields
and the state bytes. Loading checks all of it before anything is used: a truncated file, a flipped
byte, another run's config or another method each raise :class:`CheckpointError` with one line that
says why (and :meth:`MethodState.from_bytes` checks the state's own hash). Writing goes to a
temporary file that is flushed to disk and renamed over the old one, so a crash leaves either the old
checkpoint or the new one, never half a file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from collab.files import atomic_write
from collab.methods.base import MethodState

MAGIC = b"COLLABCK"
FORMAT_VERSION = 1
_MAX_HEADER_BYTES = 64 * 1024


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file and the reason."""


def _digest(meta: dict[str, Any], body: bytes) -> str:
    """sha256 over the header fields and the state bytes: any changed byte in either is noticed."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    h.update(body)
    return h.hexdigest()


def encode_checkpoint(state: MethodState, *, config_version: str, method: str) -> bytes:
    body = state.to_bytes()
    meta = {"config_version": config_version, "method": method, "step": state.step, "size": len(body)}
    head = json.dumps({**meta, "sha256": _digest(meta, body)}, sort_keys=True).encode()
    return MAGIC + bytes([FORMAT_VERSION]) + len(head).to_bytes(4, "little") + head + body


def decode_checkpoint(
    data: bytes, *, config_version: str, method: str, name: str = "checkpoint"
) -> MethodState:
    """The state in ``data``, after checking format, hash, config version and method."""

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {name} is corrupt ({reason}); not loaded")

    if len(data) < len(MAGIC) + 5:
        raise bad("truncated" if MAGIC.startswith(data[: len(MAGIC)]) else "not a collab checkpoint")
    if not data.startswith(MAGIC):
        raise bad("not a collab checkpoint")
    if data[len(MAGIC)] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {name} has format version {data[len(MAGIC)]}, this collab reads {FORMAT_VERSION}; "
            "not loaded"
        )
    start = len(MAGIC) + 5
    n = int.from_bytes(data[len(MAGIC) + 1 : start], "little")
    if n > _MAX_HEADER_BYTES or start + n > len(data):
        raise bad("truncated" if n <= _MAX_HEADER_BYTES else "bad header")
    try:
        header = json.loads(data[start : start + n])
        meta = {k: header[k] for k in ("config_version", "method", "step", "size")}
        size, digest = int(meta["size"]), header["sha256"]
    except (ValueError, KeyError, TypeError):
        raise bad("bad header") from None
    body = data[start + n :]
    if len(body) != size:
        raise bad("truncated" if len(body) < size else "trailing bytes")
    if _digest(meta, body) != digest:
        raise bad("hash mismatch")
    saved_version, saved_method = meta["config_version"], meta["method"]
    if saved_version != config_version:
        raise CheckpointError(
            f"checkpoint {name} belongs to another run config (version {str(saved_version)[:16]}, this run "
            f"{config_version}); not loaded"
        )
    if saved_method != method:
        raise CheckpointError(
            f"checkpoint {name} was written by method {str(saved_method)[:20]}, this run uses {method}; "
            "not loaded"
        )
    try:
        return MethodState.from_bytes(body)
    except ValueError as e:  # a body that hashes right but does not parse: written by a buggy writer
        raise bad(str(e)) from None


def write_checkpoint(path: str | Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (temp file, fsync, rename, fsync of the folder)."""
    atomic_write(path, data)


def read_checkpoint(path: str | Path, *, config_version: str, method: str) -> MethodState | None:
    """The checked state in the checkpoint at ``path``; ``None`` if there is no file there."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(
            f"cannot read checkpoint {path} ({e.__class__.__name__}: {e}); not loaded"
        ) from None
    return decode_checkpoint(data, config_version=config_version, method=method, name=str(path))
