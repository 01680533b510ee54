"""Compress + decompress throughput of RandK and TopK, as a ratio to a plain memory copy.

Usage: ``python bench/compression.py [--sizes 10000000 100000000] [--ratio 0.01] [--repeats 5]``

For each size it times, in the same run and interleaved: ``x.clone()`` (the memory copy baseline),
``RandK.compress(...).decompress()`` with a new step each repeat (so the coordinate set is really drawn
every time, never served from the cache), ``TopK.compress(...).decompress()``, and for reference
``torch.topk`` on |x| and ``torch.randperm(d)[:k]``. It prints the best-of-N time of each and its ratio
to the copy. Goal: both compressors within 5x of the copy.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from collab.compression import RandK, TopK


def best_time(fn: Callable[[int], object], repeats: int) -> float:
    fn(10_000)  # warm-up (allocator, thread pool)
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        fn(r)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_size(d: int, ratio: float, repeats: int, reference: bool) -> dict[str, float]:
    """Best-of-``repeats`` seconds of each case on a ``d``-vector."""
    x = torch.randn(d, generator=torch.Generator().manual_seed(0))
    k = max(1, round(ratio * d))
    randk, topk = RandK(ratio=ratio), TopK(ratio=ratio)
    cases: dict[str, Callable[[int], object]] = {
        "memory copy (clone)": lambda r: x.clone(),
        "RandK compress+decompress": lambda r: randk.compress(x, seed=7, step=r).decompress(),
        "TopK compress+decompress": lambda r: topk.compress(x, seed=7, step=r).decompress(),
    }
    if reference:
        cases["torch.topk(|x|, k)"] = lambda r: torch.topk(x.abs(), k, sorted=False)
        cases["torch.randperm(d)[:k]"] = lambda r: torch.randperm(d)[:k]
    return {name: best_time(fn, repeats) for name, fn in cases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 100_000_000])
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-reference", action="store_true", help="skip torch.topk / randperm timings")
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ratio={args.ratio}")
    print(f"{'numel':>12} {'what':<28} {'ms':>9} {'x copy':>8}")
    for d in args.sizes:
        times = bench_size(d, args.ratio, args.repeats, not args.no_reference)
        copy = times["memory copy (clone)"]
        for name, t in times.items():
            print(f"{d:>12} {name:<28} {t * 1e3:>9.1f} {t / copy:>8.2f}")


if __name__ == "__main__":
    main()
