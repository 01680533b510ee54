"""The gallery folder (collab/gallery.py) and the model keeper's bookkeeping (collab/swarm/keeper.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collab import gallery
from collab.config import load_config, with_overrides
from collab.methods.build import build_method
from collab.methods.simulated import SimulatedAggregator
from collab.swarm.keeper import ModelKeeper, checkpoint_name, kept_steps
from collab.swarm.records import parse_alive
from collab.swarm.state_sync import alive_steps
from collab.tasks.build import build_task
from tests.conftest import CONFIGS


def test_entries_list_their_images_and_old_ones_are_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gallery, "MAX_ENTRIES", 3)
    for step in (0, 10, 20, 30):
        gallery.add_entry(tmp_path, step, [("p0", b"png0", 4, 1), ("p1", b"png1", 4, step // 10)])
    index = gallery.read_index(tmp_path)
    assert [e.step for e in index.entries] == [10, 20, 30]
    assert [im.matches for im in index.entries[-1].images] == [1, 3]
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == [gallery.image_name(s, i) for s in (10, 20, 30) for i in (0, 1)]  # step 0 deleted
    assert (tmp_path / index.entries[0].images[1].file).read_bytes() == b"png1"
    # the same step again replaces its entry
    gallery.add_entry(tmp_path, 30, [("p0", b"new", 4, 4)])
    assert [(e.step, len(e.images)) for e in gallery.read_index(tmp_path).entries] == [
        (10, 2),
        (20, 2),
        (30, 1),
    ]


def test_a_missing_or_damaged_index_reads_as_empty(tmp_path: Path) -> None:
    assert gallery.read_index(tmp_path / "none").entries == []
    (tmp_path / gallery.INDEX).write_text("{not json")
    assert gallery.read_index(tmp_path).entries == []
    image = {"prompt": "x", "file": "../a.png", "samples": 1, "matches": 0}
    bad = {"format": 1, "entries": [{"step": 1, "time": 0, "images": [image]}]}
    (tmp_path / gallery.INDEX).write_text(json.dumps(bad))
    assert gallery.read_index(tmp_path).entries == [], "a file name outside the pattern is refused"


def test_alive_steps_ranks_training_peers() -> None:
    view = {
        "a": {"step": 5, "status": "training"},
        "b": {"step": 9, "status": "done"},
        "c": {"step": -1, "status": "coordinator"},
        "d": {"step": 50, "status": "left"},
        "e": {"step": True},
        "f": "junk",
        "g": {"step": 7, "status": "syncing"},
        "h": {"step": 70, "status": "flying"},
    }
    assert alive_steps(parse_alive(view)) == [(9, "b"), (7, "g"), (5, "a")]
    assert alive_steps(parse_alive(view), exclude="b") == [(7, "g"), (5, "a")]


def test_keeper_keeps_every_n_steps_and_the_last(tmp_path: Path) -> None:
    cfg = with_overrides(load_config(CONFIGS / "demo.yaml"), max_steps=100)
    task = build_task(cfg)
    method = build_method(cfg, task, SimulatedAggregator(num_devices=1), [0])
    keeper = ModelKeeper(cfg, None, method=method, folder=tmp_path, every=30)  # type: ignore[arg-type]
    assert keeper.due(0) and keeper.due(7)  # nothing kept yet: the first state seen
    keeper.last_kept = 7
    assert not keeper.due(7) and not keeper.due(36) and keeper.due(37) and keeper.due(90)
    keeper.last_kept = 95
    assert keeper.due(100), "the run's last step is always kept"
    assert not keeper.due(95)
    # a restarted keeper continues after the checkpoints already in its folder
    for step in (3, 40):
        (tmp_path / checkpoint_name(step)).write_bytes(b"x")
    (tmp_path / "step-12.ckpt.tmp").write_bytes(b"x")
    assert kept_steps(tmp_path) == [3, 40]
    again = ModelKeeper(cfg, None, method=method, folder=tmp_path, every=30)  # type: ignore[arg-type]
    assert again.last_kept == 40 and not again.due(69) and again.due(70)
