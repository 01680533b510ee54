"""The adversarial masked LM at 300 steps: MASHA with an adaptive update against uncompressed extragradient.

Usage: ``python bench/adversarial_optimizers.py [--config configs/adversarial.yaml] [--steps 300]
[--plot docs/adversarial_optimizers.png] [--jobs 2]``

Cases, all `collab simulate` runs of the same config (same model, shards, minibatches and seed), each in
its own process (``--jobs`` at a time, one torch thread each):

* ``config``        - the config as written (MASHA2 Top-k 5% + error feedback, Extra-Adam, clip, cosine);
* ``eg-same-opt``   - uncompressed extragradient with the *same* optimizer section;
* ``masha2-dense``  - MASHA2 with no compression (separates compression from the method's structure);
* ``masha2-sgd``    - the config's compression with the old plain update (``sgd``, gamma 0.03);
* ``masha1-randk``  - MASHA1 with Rand-k 5% and the config's optimizer.

Prints the final loss, bits sent per device and the ratios to ``eg-same-opt``; the unigram level of the
shipped corpus is printed for reference. Writes a loss-vs-bits plot.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

CASES: dict[str, dict[str, Any]] = {
    "config": {},
    "eg-same-opt": {"name": "extragradient", "tau": None, "device_compressor": {"name": "identity"}},
    "masha2-dense": {"device_compressor": {"name": "identity"}},
    "masha2-sgd": {"gamma": 0.03, "optimizer": {"name": "sgd"}},
    "masha1-randk": {"name": "masha1", "device_compressor": {"name": "randk", "ratio": 0.05}},
}


def _run(config: str, steps: int, case: str, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from collab.config import load_config, with_overrides
    from collab.methods.simulation import simulate

    cfg = load_config(config)
    method = cfg.method.model_dump(mode="json")
    for key, value in CASES[case].items():
        method[key] = value
    t0 = time.perf_counter()
    res = simulate(with_overrides(cfg, max_steps=steps, method=method), stop_at_target=False)
    out.put((case, res.rows, time.perf_counter() - t0))


def unigram_loss() -> float:
    """Entropy of the shipped corpus's character frequencies: what a model that ignores context gets."""
    from collab.tasks.text import load_lines

    counts = Counter("".join(load_lines()))
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default="configs/adversarial.yaml")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--plot", default="docs/adversarial_optimizers.png")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default="", help="also write every trajectory here")
    args = p.parse_args()

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    pending = list(CASES)
    running: dict[str, Any] = {}
    results: dict[str, tuple[list[tuple[int, float, float, float]], float]] = {}
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            running[name] = ctx.Process(target=_run, args=(args.config, args.steps, name, out))
            running[name].start()
        case, rows, wall = out.get(timeout=3600)
        results[case] = (rows, wall)
        running.pop(case).join()

    base_rows, _ = results["eg-same-opt"]
    base_loss, base_bits = base_rows[-1][3], base_rows[-1][1]
    print(f"unigram level of the corpus: {unigram_loss():.3f}; initial loss {base_rows[0][3]:.3f}")
    head = ("case", f"loss@{args.steps}", "MB sent/dev", "loss/EG", "EG bits/bits", "wall s")
    print(f"{head[0]:<14} {head[1]:>9} {head[2]:>12} {head[3]:>8} {head[4]:>13} {head[5]:>7}")
    for case in CASES:
        rows, wall = results[case]
        loss, bits = rows[-1][3], rows[-1][1]
        print(
            f"{case:<14} {loss:>9.3f} {bits / 8e6:>12.2f} {loss / base_loss:>8.3f} "
            f"{base_bits / bits:>13.1f} {wall:>7.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({c: r for c, (r, _) in results.items()}))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for case in CASES:
            rows, _ = results[case]
            ax.plot([r[1] / 8e6 for r in rows], [r[3] for r in rows], label=case)
        ax.axhline(unigram_loss(), color="grey", linestyle=":", label="unigram level")
        ax.set_xscale("log")
        ax.set_xlabel("MB sent per device")
        ax.set_ylabel("masked-LM loss (evaluation batch)")
        ax.set_title(f"{args.config}, {args.steps} steps, collab simulate")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
