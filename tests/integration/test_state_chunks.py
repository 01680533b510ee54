"""State downloads move in chunks, each checked as it arrives, and a download that breaks off resumes
from the chunk it stopped at - from another peer holding the same state - rather than start over."""

from __future__ import annotations

import pytest
import torch

from collab.config import SwarmConfig
from collab.methods.base import MethodState
from collab.swarm.state_sync import (
    CHUNKS_IN_FLIGHT,
    Partial,
    StateRejected,
    StateServer,
    StateSource,
    download_state,
)
from collab.swarm.timing import Timing
from collab.swarm.transport import SwarmNode

CHUNK = 16 * 1024
SOURCE = StateSource(
    config_version="v", method="masha2", timing=Timing.of(SwarmConfig(state_sync_timeout_s=10.0))
)


def _state(step: int = 7) -> MethodState:
    g = torch.Generator().manual_seed(step)
    z, w = torch.randn(20_000, generator=g), torch.randn(20_000, generator=g)
    return MethodState(step=step, z=z, w=w, fw=torch.randn(20_000, generator=g), extra={"m": torch.zeros(5)})


def _serve(node: SwarmNode, state: MethodState) -> StateServer:
    return StateServer(node, state=lambda: state, method="masha2", config_version="v", chunk_bytes=CHUNK)


@pytest.mark.timeout(120)
def test_a_download_that_broke_off_resumes_from_another_peer() -> None:
    state = _state()
    client = SwarmNode()
    a = SwarmNode(initial_peers=client.visible_maddrs())
    b = SwarmNode(initial_peers=client.visible_maddrs())
    try:
        _serve(a, state)
        _serve(b, state.clone())  # the same state, held by another peer
        size = len(state.to_bytes())
        chunks = -(-size // CHUNK)
        assert chunks >= 10

        partial = Partial()

        def die_midway(held: int, total: int) -> None:
            if held == 4:
                a.shutdown()  # the source leaves after four chunks

        # chunks 5-8 were asked for already (CHUNKS_IN_FLIGHT calls open when progress says 4): any of them,
        # all four included, may still come before the source's leaving breaks the next call
        with pytest.raises(StateRejected, match=f"broke off at chunk \\d+ of {chunks}") as broke:
            download_state(client, a.peer_key, SOURCE, partial=partial, progress=die_midway)
        held = partial.received
        assert 4 <= held <= 4 + CHUNKS_IN_FLIGHT and f"chunk {held + 1} of" in str(broke.value)
        assert partial.hash == state.hash()

        sent_before = b.bytes_sent
        got = download_state(client, b.peer_key, SOURCE, partial=partial).state
        assert got.hash() == state.hash() and torch.equal(got.z, state.z)
        # b sent the manifest, then only the chunks a had not (headers are small)
        sent = b.bytes_sent - sent_before
        assert sent < size - held * CHUNK + CHUNK // 2, (sent, size, held)
        assert partial.received == 0  # done: the next download starts afresh
    finally:
        for n in (b, a, client):
            n.shutdown()


@pytest.mark.timeout(120)
def test_every_chunk_is_checked_as_it_arrives() -> None:
    state = _state()
    client = SwarmNode()
    bad = SwarmNode(initial_peers=client.visible_maddrs())
    good = SwarmNode(initial_peers=client.visible_maddrs())
    try:
        server = _serve(bad, state)
        _serve(good, state)
        snap = server.snapshots.of(state)  # the bytes it will serve: one flipped in the third chunk
        blob = bytearray(b"".join(snap.pieces))
        blob[2 * CHUNK + 100] ^= 0xFF
        snap.pieces = [memoryview(bytes(blob))]

        partial = Partial()
        with pytest.raises(StateRejected, match=r"chunk 3 of \d+ does not match its digest"):
            download_state(client, bad.peer_key, SOURCE, partial=partial)
        assert partial.received == 2  # the good chunks are kept

        got = download_state(client, good.peer_key, SOURCE, partial=partial).state
        assert got.hash() == state.hash()
    finally:
        for n in (good, bad, client):
            n.shutdown()


@pytest.mark.timeout(120)
def test_a_state_that_moved_on_is_downloaded_afresh() -> None:
    holder = {"state": _state(1)}
    client = SwarmNode()
    server = SwarmNode(initial_peers=client.visible_maddrs())
    try:
        served = StateServer(
            server, state=lambda: holder["state"], method="masha2", config_version="v", chunk_bytes=CHUNK
        )
        partial = Partial()

        def train_on(held: int, total: int) -> None:
            if held == 3 and holder["state"].step == 1:  # two more steps, each fetched by someone
                for step in (2, 3):
                    holder["state"] = _state(step)
                    served.snapshots.of(holder["state"])

        with pytest.raises(StateRejected, match="gone"):
            download_state(client, server.peer_key, SOURCE, partial=partial, progress=train_on)
        got = download_state(client, server.peer_key, SOURCE, partial=partial).state
        assert got.step == 3 and got.hash() == holder["state"].hash()

        wrong = StateSource(config_version="other", method="masha2", timing=SOURCE.timing)
        with pytest.raises(StateRejected, match="another config"):
            download_state(client, server.peer_key, wrong)
    finally:
        server.shutdown()
        client.shutdown()


@pytest.mark.timeout(120)
def test_a_state_changed_in_place_is_never_served_stale() -> None:
    """A server hands out chunks from the state's own tensors (no copy): once they are written in place,
    that state is gone there, and the next download gets the state as it is now."""
    state = _state()
    assert b"".join(state.to_pieces()) == bytes(state.to_bytes())
    client = SwarmNode()
    server = SwarmNode(initial_peers=client.visible_maddrs())
    try:
        _serve(server, state)

        def write(held: int, total: int) -> None:
            if held == 3:  # "z" is serialized last: its chunks are not asked for yet
                state.z.add_(1.0)

        with pytest.raises(StateRejected, match="gone"):
            download_state(client, server.peer_key, SOURCE, partial=Partial(), progress=write)
        got = download_state(client, server.peer_key, SOURCE).state
        assert got.hash() == state.hash() and torch.equal(got.z, state.z)
    finally:
        server.shutdown()
        client.shutdown()
