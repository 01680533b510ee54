"""What a text-to-image model draws, measured by the scene checker (collab/tasks/scenes.py).

Usage::

    python bench/text2image_quality.py --checkpoint WORKDIR/volunteer-0.state   # e.g. after collab demo
    python bench/text2image_quality.py --simulate configs/text2image.yaml        # runs collab simulate

For each model: one argmax-decoded image per prompt for ``--prompts`` training-distribution prompts and
as many held-out prompts (each with at least one (colour, shape) pair never seen in training); prints
per-attribute accuracy (background, object colour, shape, position) and exact-scene match, and with
``--grid PNG`` writes 8 samples (temperature 1, top-k 3) for each of the config's gallery prompts.
Goals (issue 11): background >= 95% and exact scene >= 80% on training prompts, exact scene >= 50% held out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def _score(model: Any, cfg: Any, count: int) -> dict[str, dict[str, float]]:
    """Training prompts: scenes of the run's own training set. Unseen: scenes of the training
    distribution that are not in it. Held out: scenes with a (colour, shape) pair never trained on."""
    from collab.tasks import scenes, text2image

    trained = scenes.scenes(cfg.seed, cfg.task.train_scenes)
    seen = set(trained)
    unseen = [s for s in scenes.scenes(10_000, 20 * count) if s not in seen][:count]
    held = scenes.scenes(10_000, count, held_out=True)
    return {
        "training prompts": text2image.evaluate(model, trained[:count]).rates(),
        "unseen, no held-out pair": text2image.evaluate(model, unseen).rates(),
        "held-out combinations": text2image.evaluate(model, held).rates(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a text2image checkpoint (collab join --checkpoint, demo's .state)")
    src.add_argument("--simulate", metavar="CONFIG", help="run collab simulate of this config, score its end")
    p.add_argument("--max-steps", type=int, default=None, help="with --simulate: override max_steps")
    p.add_argument("--prompts", type=int, default=1000, help="prompts per set (default 1000: +-3 points)")
    p.add_argument("--grid", metavar="PNG", help="also draw the gallery prompts into this PNG")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--save", metavar="PATH", help="with --simulate: write the final state as a checkpoint")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    import torch

    from collab.config import load_config, with_overrides
    from collab.tasks.build import build_task
    from collab.tasks.torch_task import TorchTask

    t0 = time.perf_counter()
    if args.checkpoint:
        from collab.methods.checkpoint import open_checkpoint

        ck = open_checkpoint(args.checkpoint)
        if ck.config is None or ck.config.task.name != "text2image":
            raise SystemExit(f"{args.checkpoint}: not a checkpoint of a text2image run")
        cfg, z, step, source = ck.config, ck.state.z, ck.state.step, args.checkpoint
        state_hash = ck.state.hash()
    else:
        from collab.methods.simulation import simulate

        cfg = load_config(args.simulate)
        if cfg.task.name != "text2image":
            raise SystemExit(f"{args.simulate}: not a text2image config")
        if args.max_steps:
            cfg = with_overrides(cfg, max_steps=args.max_steps)
        res = simulate(cfg, stop_at_target=False)
        assert res.final_state is not None
        z, step, state_hash = res.final_state.z, res.steps, res.state_hash
        if args.save:  # a checkpoint like a volunteer's, for collab generate and later scoring
            from collab.methods.checkpoint import encode_checkpoint, write_checkpoint

            data = encode_checkpoint(
                res.final_state, config_version=cfg.version(), method=res.method, config=cfg
            )
            write_checkpoint(args.save, data)
            print(f"final state written to {args.save}")
        source = f"collab simulate {args.simulate}"
    task = build_task(cfg)
    assert isinstance(task, TorchTask) and cfg.task.name == "text2image", "a text2image run is needed"
    model, _ = task.unflatten(z)
    rates = _score(model, cfg, args.prompts)
    print(f"{source}: step {step}, state hash {state_hash}, eval loss {task.metric(z):.4f}")
    print(f"{'prompts':<24}{'background':>11}{'colour':>8}{'shape':>8}{'position':>9}{'exact scene':>12}")
    for name, r in rates.items():
        print(
            f"{name:<24}{r['background']:>11.1%}{r['colour']:>8.1%}{r['shape']:>8.1%}{r['position']:>9.1%}"
            f"{r['exact_scene']:>12.1%}"
        )
    if args.grid:
        from collab.tasks import text2image

        prompts = list(getattr(cfg.task, "prompts", [])) or ["a red ring top left on black"]
        g = torch.Generator().manual_seed(0)
        images = [
            im
            for pr in prompts
            for im in text2image.sample(model, pr, n=8, temperature=1.0, top_k=3, generator=g)
        ]
        text2image.image_grid(images).save(args.grid)
        print(f"grid of {len(prompts)} prompts x 8 samples written to {args.grid}")
    if args.json:
        wall = time.perf_counter() - t0
        print(
            json.dumps({"source": source, "step": step, "hash": state_hash, "rates": rates, "wall_s": wall})
        )


if __name__ == "__main__":
    main()
