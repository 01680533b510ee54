"""The local checkpoint file: a method state plus what it belongs to, written atomically, checked on load.

Knows :class:`MethodState` and files; nothing of the swarm. Format (version 1)::

    b"COLLABCK" | u8 format version | u32 header length | JSON header | MethodState.to_bytes()

The header holds ``config_version``, ``method``, ``step``, ``size`` and a ``sha256`` over those fields
and the state bytes. Loading checks all of it before anything is used: a truncated file, a flipped
byte, another run's config or another method each raise :class:`CheckpointError` with one line that
says why (and :meth:`MethodState.from_bytes` checks the state's own hash). Writing goes to a
temporary file that is flushed to disk and renamed over the old one, so a crash leaves either the old
checkpoint or the new one, never half a file.

The header may also hold ``config``: the whole run config as JSON, so a checkpoint can be used without
the config file (``collab export``). It is optional and outside the ``sha256`` (checkpoints without it
still load, and a collab that does not know the field still reads files that have it); it is checked
instead against ``config_version``, which the ``sha256`` covers: a config whose
:meth:`RunConfig.version` is not the saved version means a damaged file and is refused like one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collab.config import ConfigError, RunConfig, parse_config
from collab.files import atomic_write
from collab.methods.base import MethodState

MAGIC = b"COLLABCK"
FORMAT_VERSION = 1
# Bounds a damaged length field only; the whole file is read anyway. Large enough for any run config a
# volunteer can fetch (the coordinator's answers are capped at 1 MB).
_MAX_HEADER_BYTES = 2 * 1024 * 1024
_META = ("config_version", "method", "step", "size")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file and the reason."""


def _digest(meta: dict[str, Any], body: bytes | bytearray) -> str:
    """sha256 over the header fields and the state bytes: any changed byte in either is noticed."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    h.update(body)
    return h.hexdigest()


def encode_checkpoint(
    state: MethodState, *, config_version: str, method: str, config: RunConfig | None = None
) -> bytes:
    """The checkpoint bytes of ``state``; with ``config`` (whose version must be ``config_version``) the
    header also carries the run config, so the file can be used without the config file."""
    body = state.to_bytes()
    meta = {"config_version": config_version, "method": method, "step": state.step, "size": len(body)}
    header: dict[str, Any] = {**meta, "sha256": _digest(meta, body)}
    if config is not None:
        if config.version() != config_version:
            raise ValueError(f"config version {config.version()} is not config_version {config_version}")
        header["config"] = config.model_dump(mode="json")
    head = json.dumps(header, sort_keys=True).encode()
    if len(head) > _MAX_HEADER_BYTES:
        raise ValueError(f"checkpoint header of {len(head)} bytes exceeds {_MAX_HEADER_BYTES}")
    return MAGIC + bytes([FORMAT_VERSION]) + len(head).to_bytes(4, "little") + head + body


@dataclass(frozen=True)
class Checkpoint:
    """A checked checkpoint: the state and what the file says it belongs to (``config`` is ``None`` in
    files written without one)."""

    state: MethodState
    config_version: str
    method: str
    config: RunConfig | None


def parse_checkpoint(data: bytes, *, name: str = "checkpoint") -> Checkpoint:
    """The checkpoint in ``data``, after every check that needs no knowledge of the run: format, hash,
    embedded config, state. The caller compares ``config_version`` and ``method`` with its own."""

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
        meta = {k: header[k] for k in _META}
        size, digest = int(meta["size"]), header["sha256"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise bad("bad header") from None
    body = data[start + n :]
    if len(body) != size:
        raise bad("truncated" if len(body) < size else "trailing bytes")
    if _digest(meta, body) != digest:
        raise bad("hash mismatch")
    config: RunConfig | None = None
    if "config" in header:
        try:
            config = parse_config(header["config"])
        except ConfigError:
            raise bad("its embedded config is not a valid run config") from None
        if config.version() != meta["config_version"]:
            raise bad("its embedded config does not match its config version")
    try:
        state = MethodState.from_bytes(body)
    except ValueError as e:  # a body that hashes right but does not parse: written by a buggy writer
        raise bad(str(e)) from None
    return Checkpoint(
        state=state, config_version=str(meta["config_version"]), method=str(meta["method"]), config=config
    )


def decode_checkpoint(
    data: bytes, *, config_version: str, method: str, name: str = "checkpoint"
) -> MethodState:
    """The state in ``data``, after checking format, hash, config version and method."""
    ck = parse_checkpoint(data, name=name)
    if ck.config_version != config_version:
        raise CheckpointError(
            f"checkpoint {name} belongs to another run config (version {ck.config_version[:16]}, this run "
            f"{config_version}); not loaded"
        )
    if ck.method != method:
        raise CheckpointError(
            f"checkpoint {name} was written by method {ck.method[:20]}, this run uses {method}; not loaded"
        )
    return ck.state


def write_checkpoint(path: str | Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (temp file, fsync, rename, fsync of the folder)."""
    atomic_write(path, data)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(
            f"cannot read checkpoint {path} ({e.__class__.__name__}: {e}); not loaded"
        ) from None


def read_checkpoint(path: str | Path, *, config_version: str, method: str) -> MethodState | None:
    """The checked state in the checkpoint at ``path``; ``None`` if there is no file there."""
    path = Path(path)
    data = _read(path)
    if data is None:
        return None
    return decode_checkpoint(data, config_version=config_version, method=method, name=str(path))


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at ``path``, checked (format, hash, embedded config) without knowing its run in
    advance; the caller compares ``config_version`` and ``method`` with what it expects. A missing file
    raises :class:`CheckpointError` too."""
    path = Path(path)
    data = _read(path)
    if data is None:
        raise CheckpointError(f"checkpoint {path} does not exist; not loaded")
    return parse_checkpoint(data, name=str(path))


def read_checkpoint_config(path: str | Path) -> RunConfig | None:
    """The run config embedded in the checkpoint at ``path`` (the whole file checked first); ``None`` if
    the file was written without one. Raises :class:`CheckpointError` like :func:`open_checkpoint`."""
    return open_checkpoint(path).config
