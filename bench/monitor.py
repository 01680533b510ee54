"""Resource use of the monitor while it watches a 4-peer run: RSS and CPU of the monitor process tree.

Usage: ``python bench/monitor.py [--peers 4] [--steps 400]``. Starts a coordinator, ``collab monitor``
(its own process: main + its p2pd daemon) and the volunteers, samples the monitor tree's memory (RSS and
PSS, summed) and CPU time from /proc every 0.5 s while the run goes, and prints the peaks and mean CPU as a
share of one core.
Goal: under 200 MB RSS and under 5% of one core.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for e in Path("/proc").iterdir():
        if e.name.isdigit():
            try:
                ppid = int((e / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(e.name))
    out, stack = [pid], [pid]
    while stack:
        for k in kids.get(stack.pop(), []):
            out.append(k)
            stack.append(k)
    return out


def usage(pids: list[int]) -> tuple[float, float, float]:
    """(RSS bytes, PSS bytes, CPU seconds) summed over ``pids``.

    PSS (proportional set size) splits pages shared with other processes (libc, the Python binary)
    among them; RSS counts them whole, so the RSS sum is the stricter number.
    """
    rss = mem = cpu = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        cpu += (int(fields[11]) + int(fields[12])) / TICK
        pss = next((line.split()[1] for line in rollup if line.startswith("Pss:")), "0")
        mem += int(pss) * 1024
        rss += int(next((line.split()[1] for line in rollup if line.startswith("Rss:")), "0")) * 1024
    return rss, mem, cpu


def per_process(pids: list[int]) -> str:
    parts = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        rss, _, cpu = usage([pid])
        parts.append(f"{comm}[{pid}] RSS {rss / 2**20:.0f} MB, CPU {cpu:.1f} s")
    return ", ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="collab-bench-monitor-"))
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data.update(num_devices=args.peers, max_steps=args.steps)
    cfg = work / "run.yaml"
    cfg.write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "peers"]
    procs = []

    def start(*a: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*cmd, *a], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
        )
        procs.append(proc)
        return proc

    def line(proc: subprocess.Popen[str], prefix: str) -> str:
        assert proc.stdout is not None
        while True:
            text = proc.stdout.readline()
            if text.startswith(prefix):
                return text[len(prefix) :].strip()
            if not text and proc.poll() is not None:
                raise RuntimeError(f"no {prefix!r} line")

    try:
        coord = start("coordinator", "--config", str(cfg), "--port", "0")
        url = line(coord, "config server: ")
        mon = start("monitor", "--coordinator", url, "--port", "0", "--db", str(work / "m.sqlite"))
        line(mon, "dashboard: ")
        time.sleep(3)  # the monitor's start-up is not what we measure
        vols = [
            start("join", "--coordinator", url, "--device-index", str(i), "--no-progress")
            for i in range(args.peers)
        ]
        rss_peak = pss_peak = 0.0
        t0 = time.monotonic()
        *_, cpu0 = usage(tree(mon.pid))
        while any(v.poll() is None for v in vols):
            rss, pss, _ = usage(tree(mon.pid))
            rss_peak, pss_peak = max(rss_peak, rss), max(pss_peak, pss)
            time.sleep(0.5)
        *_, cpu1 = usage(tree(mon.pid))
        print("per process:", per_process(tree(mon.pid)))
        wall = time.monotonic() - t0
        print(f"{args.peers} peers, {args.steps} steps, {wall:.1f} s watched")
        mb = 2**20
        print(f"monitor tree (main + p2pd): peak RSS {rss_peak / mb:.0f} MB (PSS {pss_peak / mb:.0f} MB), "
              f"CPU {100 * (cpu1 - cpu0) / wall:.1f}% of one core")  # fmt: skip
        print("goal: under 200 MB RSS and under 5% of one core")
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
