"""Grid-search the stepsize (and MASHA's tau and ratio) on a bilinear config: bits per device to target.

Usage: ``python bench/tune_bilinear.py --config configs/bilinear.yaml --method masha1 [--ratios 0.1 0.2]
[--taus 0.7 0.8] [--gammas-over-l 0.2 0.3 0.5 0.7]``

Stepsizes are given as multiples of 1/L, L the Lipschitz constant of the averaged operator. Prints every
grid point that reached the target, best first; the `compare` entries of configs/bilinear.yaml were chosen
with it.
"""

from __future__ import annotations

import argparse

from collab.config import load_config, with_overrides
from collab.methods.simulation import simulate
from collab.tasks.bilinear import BilinearTask
from collab.tasks.build import build_task

_COMPRESSOR = {"extragradient": "identity", "masha1": "randk", "masha2": "topk"}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default="configs/bilinear.yaml")
    p.add_argument("--method", choices=sorted(_COMPRESSOR), default="masha1")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    p.add_argument("--taus", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9])
    p.add_argument("--gammas-over-l", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5, 0.7, 1.0])
    p.add_argument("--coordinates", choices=["shared", "per_device"], default="shared")
    p.add_argument("--max-steps", type=int, default=4000)
    args = p.parse_args()

    cfg = with_overrides(load_config(args.config), max_steps=args.max_steps)
    task = build_task(cfg)
    assert isinstance(task, BilinearTask), "tune_bilinear needs a bilinear config"
    lip = task.lipschitz()
    dense = args.method == "extragradient"
    ratios = [1.0] if dense else args.ratios
    taus = [None] if dense else args.taus
    rows = []
    for ratio in ratios:
        for tau in taus:
            for f in args.gammas_over_l:
                comp = {"name": _COMPRESSOR[args.method], "ratio": ratio}
                if comp["name"] == "randk":
                    comp["coordinates"] = args.coordinates
                method = {"name": args.method, "gamma": f / lip, "tau": tau, "device_compressor": comp}
                res = simulate(with_overrides(cfg, method=method))
                if res.bits_to_target is not None:
                    rows.append((res.bits_to_target, ratio, tau, f, f / lip, res.steps_to_target))
    print(f"L = {lip:.4f}; {args.method}: bits/device to {cfg.target_rel_distance:g}, best first")
    print(f"{'kbit':>10} {'ratio':>6} {'tau':>5} {'gamma*L':>8} {'gamma':>8} {'steps':>6}")
    for bits, ratio, tau, f, gamma, steps in sorted(rows):
        tau_s = "-" if tau is None else f"{tau:g}"
        print(f"{bits / 1e3:>10.1f} {ratio:>6g} {tau_s:>5} {f:>8g} {gamma:>8.4f} {steps:>6}")


if __name__ == "__main__":
    main()
