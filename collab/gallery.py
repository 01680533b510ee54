"""The sample gallery on disk: what the model keeper writes and the dashboard shows.

One folder, flat: ``step-NNNNNN-PP.png`` (the samples of prompt ``PP`` at step ``NNNNNN``) and
``index.json``, rewritten atomically after each step's images exist::

    {"format": 1, "entries": [{"step": 120, "time": 1.7e9,
                               "images": [{"prompt": "...", "file": "step-000120-00.png",
                                           "samples": 4, "matches": 3}]}, ...]}

newest entry last; ``matches`` counts the samples in which the scene checker reads back the prompt's
scene. Knows files and JSON only (no torch, no swarm), so the monitor can read it.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from collab.files import atomic_write

FORMAT = 1
INDEX = "index.json"
IMAGE_NAME = re.compile(r"^step-\d{6,}-\d{2}\.png$")
MAX_ENTRIES = 50  # older steps leave the index and their images are deleted


class GalleryImage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt: str = Field(max_length=200)
    file: str = Field(pattern=IMAGE_NAME.pattern)
    samples: int = Field(ge=1)
    matches: int = Field(ge=0)


class GalleryEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    step: int = Field(ge=0)
    time: float
    images: list[GalleryImage]


class GalleryIndex(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    format: int = FORMAT
    entries: list[GalleryEntry] = Field(default_factory=list)


def image_name(step: int, prompt_index: int) -> str:
    return f"step-{step:06d}-{prompt_index:02d}.png"


def read_index(folder: str | Path) -> GalleryIndex:
    """The gallery in ``folder``; empty when there is none yet or the index is unreadable."""
    try:
        return GalleryIndex.model_validate(json.loads((Path(folder) / INDEX).read_text(encoding="utf-8")))
    except (OSError, ValueError, ValidationError):
        return GalleryIndex()


def add_entry(folder: str | Path, step: int, images: list[tuple[str, bytes, int, int]]) -> GalleryEntry:
    """Write one step's images ``(prompt, png, samples, matches)`` and then the index that lists them
    (a reader never sees an entry whose files are missing); drops entries past :data:`MAX_ENTRIES`."""
    path = Path(folder)
    listed = []
    for i, (prompt, png, samples, matches) in enumerate(images):
        name = image_name(step, i)
        atomic_write(path / name, png)
        listed.append(GalleryImage(prompt=prompt, file=name, samples=samples, matches=matches))
    entry = GalleryEntry(step=step, time=round(time.time(), 3), images=listed)
    old = [e for e in read_index(path).entries if e.step != step]
    entries = [*old, entry][-MAX_ENTRIES:]
    atomic_write(path / INDEX, GalleryIndex(entries=entries).model_dump_json(indent=1).encode())
    kept = {im.file for e in entries for im in e.images}
    for dropped in old[: len(old) + 1 - len(entries)]:
        for im in dropped.images:
            if im.file not in kept:
                (path / im.file).unlink(missing_ok=True)
    return entry
