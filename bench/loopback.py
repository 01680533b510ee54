"""The loopback interface's byte counter, shared by the benches that count what crossed the wire."""

from __future__ import annotations

from pathlib import Path


def lo_tx_bytes() -> int:
    """Bytes sent on this network namespace's loopback (/proc/net/dev follows the reader's namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")
