"""Run a method over M simulated devices in one process (the paper's experiments, offline).

Prints a summary table, writes metrics.csv (step, bits per device so far, squared distance to the
solution relative to the start) and, with --json, ends with one JSON object. With --compare it runs
the config's `compare` list (extragradient, MASHA1, MASHA2) on the same instance and reports how many
bits per device each needs to reach the target, relative to extragradient.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from collab.config import ConfigError, MethodConfig, RunConfig, with_overrides
from peers.common import EXIT_BAD_INPUT, load_config_or_exit, task_problem

if TYPE_CHECKING:  # the simulation (and torch) loads only when a simulation runs
    from collab.methods.simulation import SimulationResult

_COMPRESSOR_FOR = {"extragradient": "identity", "masha1": "randk", "masha2": "topk"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config, e.g. configs/bilinear.yaml")
    p.add_argument("--method", choices=["extragradient", "masha1", "masha2"], help="override the method")
    p.add_argument("--ratio", type=float, help="override the compressors' keep ratio k/d")
    p.add_argument("--gamma", type=float, help="override the stepsize")
    p.add_argument("--tau", type=float, help="override MASHA's tau")
    p.add_argument("--max-steps", type=int, help="override max_steps")
    p.add_argument("--seed", type=int, help="override the seed")
    p.add_argument("--compare", action="store_true", help="run the config's comparison list side by side")
    p.add_argument("--all-steps", action="store_true", help="keep going after the target is reached")
    p.add_argument("--metrics", default="metrics.csv", help="where to write the per-step CSV")
    p.add_argument("--plot", metavar="PNG", help="plot distance against bits per device to this file")
    p.add_argument("--json", action="store_true", help="end the output with one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _method_override(cfg: RunConfig, args: argparse.Namespace) -> dict[str, Any]:
    """The method section after --method/--ratio/--gamma/--tau, as plain data."""
    base = cfg.method
    if args.method and args.method != base.name:
        # Prefer the comparison entry of that method (it carries a stepsize tuned for it).
        base = next((m for m in cfg.compare if m.name == args.method), base)
    data = base.model_dump(mode="json")
    if args.method:
        data["name"] = args.method
        wanted = _COMPRESSOR_FOR[args.method]
        for key in ("device_compressor", "server_compressor"):
            name = data[key]["name"]
            if args.method == "extragradient" or (name != "identity" and name != wanted):
                data[key]["name"] = (
                    "identity" if (key == "server_compressor" or wanted == "identity") else wanted
                )
    if args.ratio is not None:
        for key in ("device_compressor", "server_compressor"):
            if data[key]["name"] != "identity":
                data[key]["ratio"] = args.ratio
    if args.gamma is not None:
        data["gamma"] = args.gamma
    if args.tau is not None:
        data["tau"] = args.tau
    return data


def _apply_overrides(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    changes: dict[str, Any] = {"method": _method_override(cfg, args)}
    if args.max_steps is not None:
        changes["max_steps"] = args.max_steps
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.ratio is not None and cfg.compare:
        comp = []
        for m in cfg.compare:
            d = m.model_dump(mode="json")
            for key in ("device_compressor", "server_compressor"):
                if d[key]["name"] != "identity":
                    d[key]["ratio"] = args.ratio
            comp.append(d)
        changes["compare"] = comp
    return with_overrides(cfg, **changes)


def _fmt_bits(b: float | None) -> str:
    if b is None:
        return "never"
    return f"{b / 8e6:.3f} MB" if b >= 8e5 else f"{b / 8e3:.2f} kB"


def _table(results: list[SimulationResult]) -> str:
    base = next((r for r in results if r.method == "extragradient" and r.bits_to_target), None)
    metric = "rel dist" if not results or results[0].metric_name == "rel_distance" else results[0].metric_name
    head = f"{'method':<14}{'compressor':<24}{'steps':>7}{metric:>12}{'sent/device':>14}{'to target':>14}"
    lines = [head + (f"{'saving':>9}" if base else ""), "-" * (len(head) + (9 if base else 0))]
    for r in results:
        comp = r.label.split(" ", 1)[1] if " " in r.label else "dense"
        line = (
            f"{r.method:<14}{comp:<24}{r.steps:>7}{r.final_metric:>12.3e}"
            f"{_fmt_bits(r.bits_per_device):>14}{_fmt_bits(r.bits_to_target):>14}"
        )
        if base and base.bits_to_target:
            line += f"{base.bits_to_target / r.bits_to_target:>8.2f}x" if r.bits_to_target else f"{'-':>9}"
        lines.append(line)
    return "\n".join(lines)


def _plot(path: str, results: list[SimulationResult], target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ax.semilogy([row[1] / 8e6 for row in r.rows], [max(row[3], 1e-30) for row in r.rows], label=r.label)
    ax.axhline(target, color="gray", linestyle=":", linewidth=1, label="target")
    ax.set_xlabel("megabytes sent per device")
    ax.set_ylabel("||z - z*||^2 / ||z0 - z*||^2")
    ax.set_title("bilinear saddle point: distance to the solution vs. communication")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from collab.methods.simulation import default_comparison, simulate, write_metrics_csv

    cfg = load_config_or_exit(args.config)
    if cfg is None:
        return EXIT_BAD_INPUT
    try:
        cfg = _apply_overrides(cfg, args)
    except ConfigError as e:
        for line in e.problems:
            print(f"override: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    problem = task_problem(cfg)
    if problem is not None:
        print(f"{args.config}: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from collab.tasks.torch_task import FactoryError

    methods: list[MethodConfig] = default_comparison(cfg) if args.compare else [cfg.method]
    show_progress = not args.no_progress and sys.stderr.isatty()
    results = []
    for mc in methods:
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.max_steps, desc=mc.name, unit="step", file=sys.stderr, leave=False)

        def on_step(report: Any, metric: float, bar: Any = bar) -> None:
            if bar is not None:
                bar.update(1)
                if report.step % 20 == 0:
                    bar.set_postfix(dist=f"{metric:.2e}", kbits=f"{report.bits_up / 1e3:.1f}")

        try:
            results.append(simulate(cfg, method=mc, stop_at_target=not args.all_steps, on_step=on_step))
        except FactoryError as e:  # e.g. options the factory does not take
            print(f"{args.config}: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if bar is not None:
            bar.close()

    write_metrics_csv(args.metrics, results)
    if args.plot:
        _plot(args.plot, results, cfg.target_rel_distance)
    print(_table(results))
    print(f"metrics written to {args.metrics}" + (f", plot to {args.plot}" if args.plot else ""))
    if args.json:
        out: dict[str, Any] = (
            results[0].summary() if len(results) == 1 else {"results": [r.summary() for r in results]}
        )
        if len(results) > 1:
            base = next((r for r in results if r.method == "extragradient"), None)
            if base and base.bits_to_target:
                out["savings_vs_extragradient"] = {
                    r.label: (base.bits_to_target / r.bits_to_target if r.bits_to_target else None)
                    for r in results
                }
        out["run_id"], out["config_version"] = cfg.run_id, cfg.version()
        print(
            json.dumps(
                out,
                allow_nan=False,
                default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else x,
            )
        )
    ok = all(math.isfinite(r.final_metric) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    from peers.cli import main

    sys.exit(main(["simulate", *sys.argv[1:]]))
