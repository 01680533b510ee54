"""A DALL-E-like text-to-image transformer at toy scale, on the task API (collab/tasks/torch_task.py).

The DALL-E recipe: one decoder-only transformer (a ``transformers`` ``GPT2LMHeadModel`` built from a
``GPT2Config``; nothing downloaded) reads the caption's tokens, then an image-start token, then predicts
the image's tokens one by one; the loss is the cross-entropy on the image tokens only. Images are the
64 palette cells of collab/tasks/scenes.py (the palette index *is* the image token: no codebook).

Sequence layout (``SEQ_LEN`` = 79 tokens)::

    [BOS] w_1 ... w_13 (caption words, right-padded with PAD) [IMG] p_1 ... p_64

The 64 image tokens come quadrant by quadrant (:data:`ORDER`), so one object's cells are consecutive.

Training scenes are drawn from the run seed and never contain a held-out (colour, shape) pair; shard m
of M holds every M-th scene. Sampling (:func:`sample`) restricts the next-token distribution to the
palette, with a temperature and top-k.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from collab.rng import torch_seed
from collab.tasks import scenes
from collab.tasks.torch_task import TorchProblem, task_factory

PAD, BOS, IMG = 0, 1, 2
WORD_BASE = 3
PALETTE_BASE = WORD_BASE + len(scenes.WORDS)
VOCAB = PALETTE_BASE + len(scenes.PALETTE)
CAPTION_WORDS = 13  # "a red ring top left and a blue bar bottom right on black"
IMAGE_START = 1 + CAPTION_WORDS  # index of [IMG]
MIN_TEMPERATURE = 1e-3
SEQ_LEN = IMAGE_START + 1 + scenes.GRID * scenes.GRID


def encode_caption(text: str) -> list[int]:
    """``[BOS] words.. PAD.. [IMG]``; raises :class:`scenes.CaptionError` for words outside the grammar."""
    scene = scenes.parse_caption(text)  # validates the whole prompt, one-line errors
    words = scene.caption().split()
    ids = [BOS] + [WORD_BASE + scenes.WORDS.index(w) for w in words]
    return ids + [PAD] * (IMAGE_START - len(ids)) + [IMG]


# image tokens are emitted quadrant by quadrant (each quadrant row-major), so the cells of one object are
# consecutive in the sequence; images are returned row-major (scenes.render's order)
ORDER = [
    (r0 + r) * scenes.GRID + c0 + c
    for r0, c0 in ((0, 0), (0, scenes.QUAD), (scenes.QUAD, 0), (scenes.QUAD, scenes.QUAD))
    for r in range(scenes.QUAD)
    for c in range(scenes.QUAD)
]


def encode(scene: scenes.Scene) -> torch.Tensor:
    grid = scenes.render(scene)
    pixels = [PALETTE_BASE + grid[i] for i in ORDER]
    return torch.tensor(encode_caption(scene.caption()) + pixels, dtype=torch.long)


def _collate(examples: list[torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.stack(examples)
    labels = ids.clone()
    labels[:, : IMAGE_START + 1] = -100  # loss on the image tokens only
    return {"input_ids": ids, "labels": labels}


def image_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], adversary: dict) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100
    )


@task_factory
def text2image(
    *,
    seed: int,
    layers: int = 3,
    hidden: int = 96,
    heads: int = 8,
    train_scenes: int = 40000,
    eval_scenes: int = 64,
) -> TorchProblem:
    """Options: ``layers``, ``hidden``, ``heads`` of the transformer; ``train_scenes`` (all shards
    together) and ``eval_scenes`` (the loss's evaluation batch, training distribution, its own seed)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=BOS,
        eos_token_id=PAD,
        pad_token_id=PAD,
    )
    torch.manual_seed(torch_seed(seed, 0, "text2image-init") % 2**31)
    model = GPT2LMHeadModel(config)
    trained = scenes.scenes(seed, train_scenes)
    encoded = {scene: encode(scene) for scene in set(trained)}  # scenes repeat: encode each one once
    rows = torch.stack([encoded[s] for s in trained])
    held = torch.stack([encode(s) for s in scenes.scenes(seed + 1, eval_scenes)])
    g = torch.Generator().manual_seed(torch_seed(seed, 0, "text2image-eval"))
    return TorchProblem(
        model=model,
        loss=image_loss,
        data=lambda shard, num_shards: rows[shard::num_shards],
        collate=_collate,
        eval_batch=_collate(list(held), g),
    )


def sample(
    model: Any,
    prompt: str,
    *,
    n: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """``n`` images (64 palette indices, row-major) for ``prompt``; ``temperature`` 0 takes the argmax."""
    return draw(model, [prompt] * n, temperature=temperature, top_k=top_k, generator=generator)


@torch.no_grad()
def draw(
    model: Any,
    prompts: list[str],
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """One image per prompt, all prompts decoded together (one batch). A ``temperature`` below
    :data:`MIN_TEMPERATURE` takes the most likely token."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, not {temperature}")
    device = next(model.parameters()).device
    ids = torch.tensor([encode_caption(p) for p in prompts], dtype=torch.long, device=device)
    pixels: list[torch.Tensor] = []
    for _ in range(scenes.GRID * scenes.GRID):
        # the whole prefix each time (79 tokens at most): no cache API to track across transformers versions
        scores = model(input_ids=ids, use_cache=False).logits[:, -1, PALETTE_BASE:].float()
        if temperature < MIN_TEMPERATURE:
            nxt = scores.argmax(dim=-1)
        else:
            scores = scores / temperature
            if top_k is not None and top_k < scores.shape[-1]:
                kth = scores.topk(top_k, dim=-1).values[:, -1:]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = torch.softmax(scores, dim=-1).cpu()
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1).to(device)
        pixels.append(nxt)
        ids = torch.cat([ids, (nxt + PALETTE_BASE)[:, None]], dim=1)
    images = []
    for emitted in torch.stack(pixels, dim=1).cpu().tolist():
        grid = [0] * len(ORDER)
        for i, t in zip(ORDER, emitted, strict=True):
            grid[i] = t
        images.append(grid)
    return images


def evaluate(
    model: Any, prompts: list[scenes.Scene], *, temperature: float = 0.0, seed: int = 0
) -> scenes.Score:
    """One image per prompt (argmax decoding by default), scored by the scene checker."""
    score = scenes.Score()
    g = torch.Generator().manual_seed(seed)
    images = draw(model, [s.caption() for s in prompts], temperature=temperature, generator=g)
    for want, image in zip(prompts, images, strict=True):
        score.add(want, image)
    return score


def image_grid(images: list[list[int]], *, columns: int = 8, cell: int = 8) -> Any:
    """A PIL image: ``images`` side by side, each palette cell ``cell`` x ``cell`` pixels, 2 px gaps."""
    from PIL import Image

    side = scenes.GRID * cell
    columns = max(1, min(columns, len(images)))
    rows = (len(images) + columns - 1) // columns
    canvas = Image.new("RGB", (columns * (side + 2) + 2, rows * (side + 2) + 2), (40, 40, 40))
    for i, tokens in enumerate(images):
        tile = Image.new("RGB", (scenes.GRID, scenes.GRID))
        tile.putdata([scenes.RGB[scenes.PALETTE[t]] for t in tokens])
        r, c = divmod(i, columns)
        canvas.paste(
            tile.resize((side, side), Image.Resampling.NEAREST), (2 + c * (side + 2), 2 + r * (side + 2))
        )
    return canvas


def gallery_images(
    model: Any,
    prompts: list[str],
    *,
    n: int = 4,
    temperature: float = 1.0,
    top_k: int | None = 3,
    seed: int = 0,
) -> list[tuple[str, bytes, int, int]]:
    """For each prompt: ``(prompt, PNG of n samples side by side, n, samples the checker reads back as the
    prompt's scene)``. Prompts outside the grammar raise :class:`scenes.CaptionError`."""
    import io

    out = []
    g = torch.Generator().manual_seed(seed)
    for prompt in prompts:
        want = scenes.parse_caption(prompt)
        images = sample(model, want.caption(), n=n, temperature=temperature, top_k=top_k, generator=g)
        png = io.BytesIO()
        image_grid(images, columns=n).save(png, format="PNG")
        out.append((prompt, png.getvalue(), n, sum(scenes.read_scene(im) == want for im in images)))
    return out
