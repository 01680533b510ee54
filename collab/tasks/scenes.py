"""Captioned toy scenes for the text-to-image task: a renderer, a caption grammar and a checker.

A scene is a background colour and one or two objects, each a (colour, shape) in its own quadrant of an
8x8 grid of palette cells. The image *is* its token sequence: 64 palette indices, row by row (the
"palette code"; no learned codebook). Captions read like ``"a red ring top left and a blue bar bottom
right on black"``: objects in quadrant order, then the background.

Shapes are 4x4 masks drawn inside their quadrant:

    ring    ####   dot     ....   bar     ....   pillar  .##.   cross   .##.
            #..#           .##.           ####           .##.           ####
            #..#           .##.           ####           .##.           ####
            ####           ....           ....           .##.           .##.

Any two masks differ in at least 4 cells, so :func:`parse` reads a drawing with one defective cell
back unambiguously; more defects make the object unreadable. Composition is tested on held-out
(colour, shape) pairs: every colour and every shape is seen in training, but never those pairs
(:data:`HELD_OUT`); training scenes contain none of them, held-out scenes at least one.

Pure Python: no torch, no files, no network. Everything is a function of a seed.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

GRID = 8
QUAD = 4
BACKGROUNDS = ("black", "gray", "navy")
COLOURS = ("red", "green", "blue", "yellow", "white", "magenta")
PALETTE = BACKGROUNDS + COLOURS  # token i of an image is PALETTE[i]
RGB = {
    "black": (0, 0, 0),
    "gray": (110, 110, 110),
    "navy": (20, 30, 110),
    "red": (220, 30, 30),
    "green": (30, 180, 60),
    "blue": (60, 120, 255),
    "yellow": (240, 220, 40),
    "white": (250, 250, 250),
    "magenta": (210, 40, 210),
}
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
_ORIGIN = {"top left": (0, 0), "top right": (0, QUAD), "bottom left": (QUAD, 0), "bottom right": (QUAD, QUAD)}
_MASKS_TEXT = {
    "ring": ("####", "#..#", "#..#", "####"),
    "dot": ("....", ".##.", ".##.", "...."),
    "bar": ("....", "####", "####", "...."),
    "pillar": (".##.", ".##.", ".##.", ".##."),
    "cross": (".##.", "####", "####", ".##."),
}
SHAPES = tuple(_MASKS_TEXT)
MASKS = {
    name: frozenset((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == "#")
    for name, rows in _MASKS_TEXT.items()
}
HELD_OUT = frozenset(
    {
        ("red", "cross"),
        ("green", "ring"),
        ("blue", "pillar"),
        ("yellow", "dot"),
        ("white", "bar"),
        ("magenta", "ring"),
    }
)
WORDS = ("a", "and", "on", *COLOURS, *SHAPES, "top", "bottom", "left", "right", *BACKGROUNDS)


@dataclass(frozen=True)
class Obj:
    colour: str
    shape: str
    position: str


@dataclass(frozen=True)
class Scene:
    background: str
    objects: tuple[Obj, ...]  # in POSITIONS order, at most one per quadrant

    @property
    def held_out(self) -> bool:
        return any((o.colour, o.shape) in HELD_OUT for o in self.objects)

    def caption(self) -> str:
        parts = [f"a {o.colour} {o.shape} {o.position}" for o in self.objects]
        return f"{' and '.join(parts)} on {self.background}"


def render(scene: Scene) -> list[int]:
    """The scene's 64 palette tokens, row by row."""
    grid = [PALETTE.index(scene.background)] * (GRID * GRID)
    for o in scene.objects:
        r0, c0 = _ORIGIN[o.position]
        for r, c in MASKS[o.shape]:
            grid[(r0 + r) * GRID + c0 + c] = PALETTE.index(o.colour)
    return grid


def random_scene(rng: random.Random, *, held_out: bool) -> Scene:
    """A uniformly drawn scene; with ``held_out`` one containing a held-out pair, else one without."""
    while True:
        n = rng.choice((1, 2))
        positions = sorted(rng.sample(POSITIONS, n), key=POSITIONS.index)
        objects = tuple(Obj(rng.choice(COLOURS), rng.choice(SHAPES), p) for p in positions)
        scene = Scene(rng.choice(BACKGROUNDS), objects)
        if scene.held_out == held_out:
            return scene


def scenes(seed: int, count: int, *, held_out: bool = False) -> list[Scene]:
    """``count`` scenes drawn from ``seed`` (training scenes unless ``held_out``)."""
    rng = random.Random(f"scenes:{seed}:{held_out}")
    return [random_scene(rng, held_out=held_out) for _ in range(count)]


class CaptionError(ValueError):
    """A prompt the grammar cannot read; the message is one line."""


def parse_caption(text: str) -> Scene:
    """The scene a caption describes (the inverse of :meth:`Scene.caption`)."""
    words = text.lower().replace(",", " ").split()
    unknown = sorted({w for w in words if w not in WORDS})
    if unknown:
        raise CaptionError(f"unknown words {unknown}; the vocabulary is: {' '.join(WORDS)}")
    if len(words) < 2 or words[-2] != "on" or words[-1] not in BACKGROUNDS:
        raise CaptionError("a prompt ends with 'on <background>' (" + ", ".join(BACKGROUNDS) + ")")
    objects, rest = [], words[:-2]
    for chunk in " ".join(rest).split(" and "):
        w = chunk.split()
        if len(w) != 5 or w[0] != "a" or w[1] not in COLOURS or w[2] not in SHAPES:
            raise CaptionError(
                f"cannot read {chunk!r}: objects read 'a <colour> <shape> <top|bottom> <left|right>'"
            )
        position = f"{w[3]} {w[4]}"
        if position not in POSITIONS:
            raise CaptionError(f"cannot read position {position!r}: one of {', '.join(POSITIONS)}")
        objects.append(Obj(w[1], w[2], position))
    if not 1 <= len(objects) <= 2 or len({o.position for o in objects}) != len(objects):
        raise CaptionError("a prompt has one or two objects, in different positions")
    return Scene(words[-1], tuple(sorted(objects, key=lambda o: POSITIONS.index(o.position))))


UNREADABLE = Obj("?", "?", "?")
MAX_DEFECTS = 1  # masks differ in >= 4 cells, so one defect never makes a drawing ambiguous


def parse(tokens: list[int]) -> tuple[str, dict[str, Obj]]:
    """Read an image back by the renderer's rules: its background and its objects by position.

    Background: the most common palette entry. Each quadrant: its cells that differ from the
    background; none -> no object there; else the colour is their most common entry and the shape the
    mask nearest to them. An object whose colour is not an object colour, or with more than
    :data:`MAX_DEFECTS` defects (cells off the nearest mask plus cells of another colour), is
    :data:`UNREADABLE` (it matches no caption and counts as no attribute).
    """
    if len(tokens) != GRID * GRID or not all(0 <= t < len(PALETTE) for t in tokens):
        raise ValueError(f"an image is {GRID * GRID} palette indices below {len(PALETTE)}")
    bg = Counter(tokens).most_common(1)[0][0]
    objects: dict[str, Obj] = {}
    for position in POSITIONS:
        r0, c0 = _ORIGIN[position]
        cells = {
            (r, c): tokens[(r0 + r) * GRID + c0 + c]
            for r in range(QUAD)
            for c in range(QUAD)
            if tokens[(r0 + r) * GRID + c0 + c] != bg
        }
        if not cells:
            continue
        token = Counter(cells.values()).most_common(1)[0][0]
        off_colour = sum(t != token for t in cells.values())
        drawn = frozenset(cells)
        shape, distance = min(((s, len(drawn ^ m)) for s, m in MASKS.items()), key=lambda x: x[1])
        ok = PALETTE[token] in COLOURS and distance + off_colour <= MAX_DEFECTS
        colour = PALETTE[token]
        objects[position] = Obj(colour, shape, position) if ok else UNREADABLE
    return PALETTE[bg], objects


def read_scene(tokens: list[int]) -> Scene | None:
    """The scene an image shows, or ``None`` when a part of it is unreadable or the background is not one."""
    background, objects = parse(tokens)
    if background not in BACKGROUNDS or UNREADABLE in objects.values():
        return None
    return Scene(background, tuple(objects[p] for p in POSITIONS if p in objects))


@dataclass
class Score:
    """Per-attribute accuracy over (prompt, image) pairs."""

    images: int = 0
    background: int = 0
    objects: int = 0
    colour: int = 0
    shape: int = 0
    position: int = 0
    exact: int = 0

    def add(self, want: Scene, tokens: list[int]) -> None:
        """Score one image for ``want``: position counts an object drawn in the right quadrant."""
        background, by_pos = parse(tokens)
        self.images += 1
        self.objects += len(want.objects)
        self.background += background == want.background
        for o in want.objects:
            g = by_pos.get(o.position)
            g = None if g is UNREADABLE else g
            self.position += g is not None
            self.colour += g is not None and g.colour == o.colour
            self.shape += g is not None and g.shape == o.shape
        self.exact += read_scene(tokens) == want

    def rates(self) -> dict[str, float]:
        n, k = max(1, self.images), max(1, self.objects)
        return {
            "background": self.background / n,
            "colour": self.colour / k,
            "shape": self.shape / k,
            "position": self.position / k,
            "exact_scene": self.exact / n,
        }
