"""How far Top-k compression can go on the char-LM in a short run: MASHA2 against the usual compressed
gradient methods, all with the same AdamW update, in one process each.

Usage: ``python bench/compressed_baselines.py [--steps 80] [--ratios 0.005,0.02,0.05] [--jobs 2]``

The problem is ``bench/vs_hivemind.py``'s: ``examples/charlm.yaml`` (GPT-2-style character LM, 3 shards,
16 examples per device and step, the run's seed), ``--steps`` steps, the example's AdamW recipe (lr
0.003, weight decay on matrices, clipping at 1.0, its warmup capped at ``steps/5``, then cosine). Every
case applies that update (:class:`collab.methods.optimizers.UpdateRule`) to its estimate of the mean
gradient and is scored by the task's evaluation loss:

* ``adam``     - the exact mean of the 3 devices' gradients every step: hivemind.Optimizer's recipe without
  compression (one gradient per device and step, 32 bits per coordinate);
* ``ef``       - classic error feedback (Seide et al. 2014; Karimireddy et al. 2019): device ``m`` sends
  ``c = TopK(e_m + g_m)`` and keeps ``e_m += g_m - c``; the update uses the mean of the ``c``;
* ``ef21``     - EF21 (Richtarik et al. 2021): device ``m`` keeps an estimate ``h_m`` (first the exact
  gradient, one dense round), sends ``c = TopK(g_m - h_m)`` and sets ``h_m += c``; the update uses the
  mean of the ``h_m``;
* ``masha2``   - ``collab simulate`` of the config with Top-k at the same ratio, tau 0.95 (two gradients
  per device and step, a 4x-batch dense refresh with probability 0.05);
* ``extragradient`` - ``collab simulate`` with uncompressed extragradient and the same update.

Prints the final evaluation loss and MB sent per device (device to group, as ``collab simulate`` counts
bits: Top-k as values plus coded indices). The point: whether the
gap between collab's compressed runs and uncompressed Adam in ``bench/vs_hivemind.py`` is MASHA's or
any Top-k method's at that compression and run length.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

DEVICES = 3


def _config(steps: int, method: dict[str, Any] | None = None) -> Any:
    """vs_hivemind's problem (its :func:`base_config`), with ``method`` changed."""
    from vs_hivemind import base_config

    from collab.config import with_overrides

    cfg = base_config(steps)
    return cfg if method is None else with_overrides(cfg, method=method)


def _baseline(case: str, ratio: float, steps: int) -> dict[str, float]:
    """``adam``, ``ef`` or ``ef21`` with the config's update rule, in this process."""
    import torch

    from collab.compression import TopK
    from collab.methods.build import build_update_rule
    from collab.tasks.build import build_task

    cfg = _config(steps)
    task = build_task(cfg)
    rule = build_update_rule(cfg.method, task, max_steps=steps)
    ops = [task.local_operator(m) for m in range(DEVICES)]
    x = task.initial_point().clone()
    moments = rule.init_moments(x.numel())
    d, comp = x.numel(), TopK(ratio=ratio)
    bits = 0.0
    errors = [torch.zeros(d) for _ in range(DEVICES)]
    estimates: list[torch.Tensor] = []
    for k in range(steps):
        grads = [op.evaluate([x], step=k)[0] for op in ops]
        if case == "adam":
            direction, bits = torch.stack(grads).mean(0), bits + 32 * d
        elif case == "ef":
            sent = []
            for m, g in enumerate(grads):
                msg = comp.compress(errors[m] + g, seed=0, step=k)
                c = msg.decompress()
                errors[m] += g - c
                sent.append(c)
            direction, bits = torch.stack(sent).mean(0), bits + msg.bits
        elif case == "ef21":
            if not estimates:  # the exact gradients once: a dense round
                estimates, bits = [g.clone() for g in grads], bits + 32 * d
            else:
                for m, g in enumerate(grads):
                    msg = comp.compress(g - estimates[m], seed=0, step=k)
                    estimates[m] += msg.decompress()
                bits += msg.bits
            direction = torch.stack(estimates).mean(0)
        else:
            raise ValueError(case)
        plan = rule.plan(moments, k, x)
        plan.extrapolate(direction)  # the same direction twice: exactly one AdamW step
        x, moments = plan.update(direction)
    return {"loss": task.metric(x), "mb": bits / 8e6}


def _simulated(case: str, ratio: float, steps: int) -> dict[str, float]:
    from collab.methods.simulation import simulate

    if case == "extragradient":
        method: dict[str, Any] = {
            "name": "extragradient",
            "tau": None,
            "device_compressor": {"name": "identity"},
        }
    else:
        method = {"name": "masha2", "tau": 0.95, "device_compressor": {"name": "topk", "ratio": ratio}}
    res = simulate(_config(steps, method), stop_at_target=False)
    return {"loss": res.final_metric, "mb": res.bits_per_device / 8e6}


def _run(job: tuple[str, float, int]) -> tuple[str, float, dict[str, float], float]:
    case, ratio, steps = job
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    fn = _baseline if case in ("adam", "ef", "ef21") else _simulated
    return case, ratio, fn(case, ratio, steps), time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--ratios", default="0.005,0.02,0.05", help="Top-k keep ratios, comma-separated")
    p.add_argument("--jobs", type=int, default=2, help="cases run at once (one torch thread each)")
    args = p.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    cases = [("adam", 1.0), ("extragradient", 1.0)]
    cases += [(c, r) for r in ratios for c in ("ef", "ef21", "masha2")]
    results: dict[tuple[str, float], dict[str, float]] = {}
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for case, ratio, row, took in pool.imap_unordered(_run, [(c, r, args.steps) for c, r in cases]):
            results[(case, ratio)] = row
            print(
                f"  {case} {ratio:g}: loss {row['loss']:.4f}, {row['mb']:.2f} MB ({took:.0f} s)", flush=True
            )
    adam = results[("adam", 1.0)]
    print(
        f"\n{DEVICES} devices, {args.steps} steps, the example's AdamW; "
        f"uncompressed Adam: {adam['loss']:.4f}\n"
    )
    print("| case | Top-k | eval loss | MB sent per device | Adam's bytes / these | loss / Adam's |")
    print("|---|---:|---:|---:|---:|---:|")
    for case, ratio in cases:
        row = results[(case, ratio)]
        k = "-" if ratio == 1.0 else f"{ratio:.1%}"
        print(
            f"| {case} | {k} | {row['loss']:.4f} | {row['mb']:.2f} | {adam['mb'] / row['mb']:.1f} "
            f"| {row['loss'] / adam['loss']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
