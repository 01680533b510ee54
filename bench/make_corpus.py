"""Regenerate collab/tasks/data/corpus.txt: a small English-like corpus for the adversarial MLM task.

Sentences are drawn from a fixed grammar with a fixed seed, so the file is reproducible; it is shipped in
the repository (no download at run time). Usage: ``python bench/make_corpus.py [--lines 6000]``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

SUBJECTS = [
    "the cat",
    "a small dog",
    "the old man",
    "my sister",
    "the red bird",
    "a young girl",
    "the farmer",
    "our teacher",
    "the tall tree",
    "a quiet river",
    "the baker",
    "the children",
    "a grey horse",
]
VERBS = ["sees", "likes", "finds", "follows", "carries", "paints", "watches", "remembers", "builds", "greets"]
OBJECTS = [
    "the green field",
    "a wooden box",
    "the blue sky",
    "an empty road",
    "the warm bread",
    "a bright lamp",
    "the little house",
    "a long letter",
    "the open window",
    "a round stone",
    "the cold water",
]
PLACES = [
    "in the morning",
    "near the lake",
    "after the rain",
    "at the market",
    "under the bridge",
    "before dinner",
    "in the garden",
    "on the hill",
    "during the storm",
    "at night",
]
LINKS = ["and then", "because", "while", "but", "so"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}"
    if rng.random() < 0.4:
        s += f" {rng.choice(LINKS)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    return s + "."


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--lines", type=int, default=6000)
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parent.parent / "collab/tasks/data/corpus.txt")
    )
    args = p.parse_args()
    rng = random.Random(2022)
    Path(args.out).write_text("\n".join(sentence(rng) for _ in range(args.lines)) + "\n")


if __name__ == "__main__":
    main()
