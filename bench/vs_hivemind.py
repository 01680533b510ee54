"""collab against the real ``hivemind.Optimizer``: same model, shards, samples and steps, 3 peers on loopback.

Usage::

    python bench/vs_hivemind.py [--steps 80] [--cases all] [--capped/--no-capped] [--rate 100mbit]
                                [--out runs/vs_hivemind.json] [--plot docs/vs_hivemind.png]

Every case runs in a network namespace of its own (``unshare --net``, as root), so the namespace's
loopback counters (``/proc/net/dev``; ``/sys/class/net`` shows the host's) count exactly that case's
traffic: payload, libp2p and TCP framing, DHT traffic, process start-up included, for collab also its
coordinator's config server and monitor. "Wire MB per peer" is the loopback's transmitted bytes over the
whole case divided by 3. With ``--capped`` every case runs again with the namespace's loopback shaped to
one 100 Mbit/s link shared by all peers (``tc qdisc add dev lo root tbf rate 100mbit burst 256kbit latency
50ms`` and MTU 1500: tbf drops every packet bigger than its 32 KB bucket, and loopback's 64 KB MTU makes
full TCP segments that big). Without namespaces (no ``unshare``) the host loopback is counted, other
traffic included, and there is no capped run; the output says so.

The problem (``examples/charlm.yaml``): the GPT-2-style character LM, 3 shards, 16 examples per peer and
step, ``--steps`` global steps, the run's seed (the same initial weights everywhere), the example's AdamW
recipe (lr 0.003, weight decay 0.01 on matrices, clipping at 1.0, warmup then cosine decay; warmup capped
at steps/5), evaluated on the task's evaluation batch (``TorchTask.metric``). Shard ``m`` uses
``TorchOperator.batch(k, 16)`` as its step-``k`` minibatch in both systems.

* ``collab-*``: ``collab demo --peers 3`` (a coordinator and 3 ``collab join`` processes) on a config
  derived from ``examples/charlm.yaml``: MASHA2 with Top-k 0.5% and MASHA1 with shared Rand-k 5%, tau
  0.99, each with the example's AdamW as Extra-Adam (Top-k 0.5% keeps collab's bytes 10x below hivemind's
  fp16; MASHA1 with Rand-k 2-4% spikes or diverges with AdamW here, 5% is the sparsest that stays
  stable); and MASHA2 with Top-k 10%, tau 0.95 and no pull toward the reference (``anchor`` 0: the
  lighter compression that comes nearest uncompressed Adam in ``bench/compressed_baselines.py``'s
  setting, docs/ALGORITHMS.md). MASHA evaluates the gradient twice per step on the same minibatch, and
  its reference point (at the start and, with probability ``1 - tau``, after a step) is refreshed with a
  4x minibatch and one dense exchange: "samples per peer" counts those.
* ``hivemind-*``: a bootstrap DHT and 3 peer processes (this file, ``--_hivemind-peer``), each a
  ``hivemind.Optimizer`` (``use_local_updates=False``, ``target_batch_size`` = 3 x 16,
  ``batch_size_per_step`` = 16) over torch's AdamW with the same hyperparameters, decay mask, clipping (of
  the averaged gradient) and schedule (hivemind's ``scheduler``, stepped once per epoch). Each epoch a peer
  computes its minibatch, reports it, waits until hivemind's progress tracker has seen the swarm's whole
  target batch, and calls ``opt.step()``: the 3 peers average their gradients and step. Should hivemind
  not advance, the peer takes another minibatch (hivemind's own behaviour; counted as extra). Gradient
  compression: none, fp16, 8-bit (``Uniform8BitQuantization``; reported as broken when it fails on the
  installed numpy) and PowerSGD (``PowerSGDGradientAverager``, rank ``--powersgd-rank``). Settings for a
  3-peer loopback swarm: ``matchmaking_time`` 0.5 s (collab's ``min_matchmaking_time_s``; hivemind suggests
  3-5 s), groups of 3 (a full group starts at once), the tracker fetching the swarm's progress every 0.2 s
  (hivemind adapts it between 0.5 and 10 s, and peers that notice an epoch's end late miss the group and
  download the whole state), no state averaging (``average_state_every`` > steps: the fewest bytes; the
  notes show how far the peers drift apart instead).

Wall-clock: from the first step to the last peer's end (hivemind: from the start signal; collab: from its
first record, right after the initial dense round). A case "reaches" a loss when its eval loss (the peers'
mean) comes within ``REACH_TOL`` of it. The goal (issue 10): collab reaches the final loss of hivemind's
best case with at least 10x fewer wire bytes; the capped run gives each case's time to that loss. Every
child process is stopped by its process group, then anything left in the case's namespace is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from loopback import lo_tx_bytes

REPO = Path(__file__).resolve().parent.parent
BASE_CONFIG = REPO / "examples" / "charlm.yaml"
PEERS = 3
SHAPED = ("rate", "100mbit", "burst", "256kbit", "latency", "50ms")
HIVEMIND_CODECS = ("none", "fp16", "8bit", "powersgd")
COLLAB_CASES = {  # name -> (method, compressor, ratio, tau, anchor); see the module docstring for the choice
    "collab-masha2-topk": ("masha2", "topk", 0.005, 0.99, None),
    "collab-masha1-randk": ("masha1", "randk", 0.05, 0.99, None),
    "collab-masha2-topk10": ("masha2", "topk", 0.1, 0.95, 0.0),
}
REACH_TOL = 1e-3  # "reached a loss": within this much of it (fp16 and none end within ~1e-4 of each other)
ALL_CASES = [*COLLAB_CASES, *(f"hivemind-{c}" for c in HIVEMIND_CODECS)]


# ---------------------------------------------------------------- shared settings


def base_config(steps: int) -> Any:
    from collab.config import load_config, with_overrides

    cfg = load_config(BASE_CONFIG)
    warmup = min(cfg.method.optimizer.schedule.warmup_steps, steps // 5)  # short runs keep a warmup too
    schedule = {"warmup_steps": warmup}
    return with_overrides(
        cfg, num_devices=PEERS, max_steps=steps, method={"optimizer": {"schedule": schedule}}
    )


def collab_config(case: str, steps: int) -> dict[str, Any]:
    method, compressor, ratio, tau, anchor = COLLAB_CASES[case]
    cfg = base_config(steps).model_dump(mode="json")
    cfg["run_id"] = case
    cfg["method"].update(
        name=method, tau=tau, anchor=anchor, device_compressor={"name": compressor, "ratio": ratio}
    )
    return cfg


# ---------------------------------------------------------------- loopback counters


class LoSampler(threading.Thread):
    """Samples (wall time, loopback tx bytes) every ``period_s`` until stopped."""

    def __init__(self, period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.period_s, self.samples = period_s, [(time.time(), lo_tx_bytes())]
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            self.samples.append((time.time(), lo_tx_bytes()))

    def stop(self) -> list[tuple[float, int]]:
        self._stop_event.set()
        self.join(timeout=5)
        self.samples.append((time.time(), lo_tx_bytes()))
        return self.samples


def bytes_at(samples: list[tuple[float, int]], t: float) -> float:
    """Loopback bytes at time ``t`` since the first sample (linear between samples)."""
    base = samples[0][1]
    for (t0, b0), (t1, b1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            frac = 0.0 if t1 <= t0 else (t - t0) / (t1 - t0)
            return b0 - base + frac * (b1 - b0)
    return float(samples[-1][1] - base if t > samples[-1][0] else 0)


# ---------------------------------------------------------------- processes


def start(cmd: list[str], log: Path, **kw: Any) -> subprocess.Popen[Any]:
    return subprocess.Popen(
        cmd, stdout=kw.pop("stdout", log.open("w")), stderr=subprocess.STDOUT, start_new_session=True, **kw
    )


def stop(proc: subprocess.Popen[Any], first: int = signal.SIGTERM, wait_s: float = 15.0) -> None:
    """Stop a child's process group: ``first``, then SIGKILL if it lingers."""
    for sig, wait in ((first, wait_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # grandchildren left in the group


def sweep_namespace() -> None:
    """SIGKILL every other process in this (private) network namespace: all of them are ours."""
    mine = os.readlink("/proc/self/ns/net")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "net") == mine:
                    os.kill(int(entry.name), signal.SIGKILL)


# ---------------------------------------------------------------- a hivemind peer (its own process)


def codec_problem(codec: str) -> str | None:
    """None when hivemind's codec round-trips a tensor here, else one line saying why not."""
    if codec not in ("fp16", "8bit"):
        return None
    import numpy as np
    import torch
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto.runtime_pb2 import CompressionType

    kind = CompressionType.FLOAT16 if codec == "fp16" else CompressionType.UNIFORM_8BIT
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    try:
        y = deserialize_torch_tensor(serialize_torch_tensor(x, kind))
    except Exception as e:  # the codec itself fails: report it, never run it
        return f"broken on numpy {np.__version__} ({type(e).__name__}: {e})"
    err = float((x - y).norm() / x.norm())
    return None if err < 0.05 else f"round trip error {err:.2g} on numpy {np.__version__}"


def _adamw_with_clipping(clip_norm: float | None) -> type:
    import torch

    class ClippedAdamW(torch.optim.AdamW):
        """torch's AdamW after clipping the (averaged) gradient's global norm, as collab's rule does."""

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            if clip_norm is not None:
                grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(grads, clip_norm)
            return super().step(closure)

    return ClippedAdamW


def hivemind_peer(args: argparse.Namespace) -> None:
    """One hivemind.Optimizer peer: trains shard ``args.index`` for ``args.steps`` epochs, writes JSON."""
    from functools import partial

    import hivemind
    import torch
    from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

    from collab.methods.build import build_update_rule
    from collab.tasks.build import build_task
    from collab.tasks.torch_task import TorchTask

    work, i, steps = Path(args.workdir), args.index, args.steps
    cfg = base_config(steps)
    task = build_task(cfg)
    if not isinstance(task, TorchTask):
        raise SystemExit(f"the benchmark needs a torch task, not {cfg.task.name!r}")
    op = task.local_operator(i)
    model, params = op.model.model, op.model.params
    batch_size = cfg.task.batch_size
    oc = cfg.method.optimizer
    schedule = build_update_rule(cfg.method, task, max_steps=steps).schedule
    decay = {s.name: s.decay for s in task.segments()}
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if decay[n]], "weight_decay": oc.weight_decay},
        {"params": [p for n, p in named if not decay[n]], "weight_decay": 0.0},
    ]
    codecs = {
        "none": hivemind.compression.NoCompression(),
        "fp16": hivemind.compression.Float16Compression(),
        "8bit": hivemind.compression.Uniform8BitQuantization(),
    }
    compression: dict[str, Any] = {}
    if args.codec == "powersgd":
        compression["grad_averager_factory"] = partial(
            PowerSGDGradientAverager, averager_rank=args.powersgd_rank
        )
    else:
        compression["grad_compression"] = codecs[args.codec]
    torch.manual_seed(cfg.seed)  # PowerSGD's random Q starts equal on every peer

    dht = hivemind.DHT(start=True, initial_peers=[args.initial_peer], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=f"vs-{args.codec}",
        params=groups,
        optimizer=partial(
            _adamw_with_clipping(oc.clip_norm), lr=cfg.method.gamma, betas=(oc.beta1, oc.beta2), eps=oc.eps
        ),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule.factor),
        batch_size_per_step=batch_size,
        target_batch_size=PEERS * batch_size,
        use_local_updates=False,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=30.0,
        average_state_every=steps + 1,  # no state averaging: see the module docstring
        averager_opts={"target_group_size": PEERS, "request_timeout": args.matchmaking_time / 2},
        # a fixed, short fetch period: hivemind's adaptive one (up to 10 s) lets a peer notice the end
        # of an epoch seconds after the others, miss their group and download the state
        tracker_opts={
            "min_refresh_period": args.refresh_period,
            "max_refresh_period": args.refresh_period,
            "default_refresh_period": args.refresh_period,
        },
        verbose=True,  # its log says "Averaged gradients with N peers" and any state download
        **compression,
    )
    try:
        (work / f"ready-{i}").write_text("1")
        while not (work / "go").exists():
            time.sleep(0.02)
        t0 = time.time()
        log = [(t0, 0, task.metric(flat(params)))]
        samples = batches = extra = 0
        last_epoch = -1
        while opt.local_epoch < steps:
            epoch = opt.local_epoch
            if epoch != last_epoch:  # the epoch's minibatch: collab's step-`epoch` batch of this shard
                batch, last_epoch = op.batch(epoch, batch_size), epoch
            else:  # hivemind did not advance: another minibatch, from steps nobody else uses
                extra += 1
                batch = op.batch(steps + extra, batch_size)
            opt.zero_grad()
            task.problem.loss(model, batch, {}).backward()
            samples, batches = samples + batch_size, batches + 1
            opt.tracker.report_local_progress(epoch, opt.grad_averager.local_samples_accumulated + batch_size)
            # step once the swarm has reported the whole target batch (hivemind's tracker alone would also
            # end the epoch on its extrapolated ETA, before a slower peer has reported its minibatch,
            # which then misses the group and downloads the state)
            tracker, wait_until = opt.tracker, time.monotonic() + 60
            while time.monotonic() < wait_until and not (
                tracker.global_epoch > epoch
                or tracker.global_progress.samples_accumulated >= tracker.target_batch_size
            ):
                time.sleep(0.005)
            opt.step()
            if opt.local_epoch != epoch:
                log.append((time.time(), opt.local_epoch, task.metric(flat(params))))
        z = flat(params)
        torch.save(z, work / f"params-{i}.pt")
        result = {
            "index": i,
            "final_loss": task.metric(z),
            "samples": samples,
            "batches": batches,
            "extra_batches": extra,
            "epochs": opt.local_epoch,
            "t0": t0,
            "t_end": time.time(),
            "log": log,
        }
        (work / f"result-{i}.json").write_text(json.dumps(result))
        (work / f"done-{i}").write_text("1")
        while not all((work / f"done-{j}").exists() for j in range(PEERS)):
            time.sleep(0.05)  # stay in the swarm until everybody's last round is over
    finally:
        opt.shutdown()
        dht.shutdown()


def flat(params: list[Any]) -> Any:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in params]).float().clone()


# ---------------------------------------------------------------- one case (inside its namespace)


def _wait_files(work: Path, names: list[str], procs: list[subprocess.Popen[Any]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((work / n).exists() for n in names):
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"peer {dead[0]} exited with code {procs[dead[0]].returncode} (see {work})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {names} (see {work})")
        time.sleep(0.05)


def run_hivemind(codec: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import hivemind
    import torch

    problem = codec_problem(codec)
    if problem is not None:
        return {"broken": problem}
    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddr = str(boot.get_visible_maddrs()[0])
    procs: list[subprocess.Popen[Any]] = []
    try:
        for i in range(PEERS):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_hivemind-peer", str(i)]
            cmd += ["--_codec", codec, "--_initial-peer", maddr, "--_workdir", str(work)]
            cmd += ["--steps", str(args.steps), "--powersgd-rank", str(args.powersgd_rank)]
            cmd += [
                "--matchmaking-time",
                str(args.matchmaking_time),
                "--refresh-period",
                str(args.refresh_period),
            ]
            procs.append(start(cmd, work / f"peer-{i}.log", cwd=REPO))
        _wait_files(work, [f"ready-{i}" for i in range(PEERS)], procs, 300)
        (work / "go").write_text("1")
        _wait_files(work, [f"done-{i}" for i in range(PEERS)], procs, args.case_timeout)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=60)  # leaving the swarm; stop() below ends any that hang
    finally:
        for p in procs:
            stop(p)
        boot.shutdown()
    peers = [json.loads((work / f"result-{i}.json").read_text()) for i in range(PEERS)]
    logs = "\n".join((work / f"peer-{i}.log").read_text(errors="replace") for i in range(PEERS))
    zs = [torch.load(work / f"params-{i}.pt") for i in range(PEERS)]
    t0 = min(r["t0"] for r in peers)
    losses = [r["final_loss"] for r in peers]
    return {
        "final_loss": sum(losses) / PEERS,
        "peer_losses": losses,
        "max_param_diff": max(float((z - zs[0]).abs().max()) for z in zs),
        "samples_per_peer": sum(r["samples"] for r in peers) / PEERS,
        "extra_batches": sum(r["extra_batches"] for r in peers),
        # from hivemind's own log lines (verbose=True), summed over the peers
        "rounds_full_group": logs.count(f"Averaged gradients with {PEERS} peers"),
        "rounds_local_only": logs.count("Proceeding with local gradients"),
        "state_downloads": logs.count("Downloading parameters from peer"),
        "epochs": min(r["epochs"] for r in peers),
        "t0": t0,
        "train_s": max(r["t_end"] for r in peers) - t0,
        # peer 0's clock, the peers' mean loss (their logs hold the same epochs: all finish every epoch)
        "curve": [
            (t - t0, step, sum(r["log"][k][2] for r in peers) / PEERS)
            for k, (t, step, _) in enumerate(peers[0]["log"])
            if all(len(r["log"]) > k and r["log"][k][1] == step for r in peers)
        ],
    }


def run_collab(case: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import yaml

    cfg = collab_config(case, args.steps)
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "peers", "demo", "--config", str(path), "--peers", str(PEERS)]
    cmd += ["--max-steps", str(args.steps), "--json", "--workdir", str(work / "demo")]
    cmd += ["--timeout", str(args.case_timeout)]
    out = work / "demo.out"
    demo = start(cmd, work / "demo.err", stdout=out.open("w"), cwd=REPO)
    try:
        demo.wait(timeout=args.case_timeout + 120)
    finally:
        stop(demo, first=signal.SIGINT)  # SIGINT: the demo stops its coordinator and volunteers itself
    lines = out.read_text().strip().splitlines()
    if demo.returncode != 0 or not lines:
        raise RuntimeError(f"collab demo exited with code {demo.returncode} (see {work})")
    summary = json.loads(lines[-1])
    logs = []
    for i in range(PEERS):
        recs = [json.loads(x) for x in (work / "demo" / f"volunteer-{i}.jsonl").read_text().splitlines()]
        logs.append(recs)
    inits = [r for recs in logs for r in recs if r.get("event") == "initialized"]
    t0 = min(r["time"] for r in inits)
    steps0 = [r for r in logs[0] if "metric" in r and "event" not in r]
    refreshes = sum(1 for r in steps0 if r.get("refreshed"))
    batch = cfg["task"]["batch_size"]
    last = [max(r["time"] for r in recs if "metric" in r) for recs in logs]
    return {
        "final_loss": summary["final_metric"],
        "peer_losses": [summary["final_metric"]] * PEERS,
        "max_param_diff": 0.0 if len(set(summary["state_hashes"].values())) == 1 else float("nan"),
        "same_state": len(set(summary["state_hashes"].values())) == 1,
        # one minibatch per step (both evaluations), a 4x batch at the start and at every refresh
        "samples_per_peer": batch * (summary["steps"] + 4 * (1 + refreshes)),
        "refreshes": refreshes,
        "epochs": summary["steps"],
        "collab_wire_bytes_per_peer": sum(summary["wire_bytes_per_peer"].values()) / PEERS,
        "collab_bits_up_per_peer": sum(summary["bits_per_peer"].values()) / PEERS,
        "t0": t0,
        "train_s": max(last) - t0,
        "curve": [(r["time"] - t0, r["step"], r["metric"]) for r in steps0],
    }


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_case(args: argparse.Namespace) -> None:
    """Entry of ``--_case``: inside the case's own namespace (unless --_shared-net), writes result.json."""
    work = Path(args._workdir)
    result: dict[str, Any] = {"case": args._case, "capped": args._capped, "namespace": not args._shared_net}
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if not args._shared_net:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
            if args._capped:
                subprocess.run(["ip", "link", "set", "lo", "mtu", "1500"], check=True)
                tc = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", *SHAPED]
                tc[tc.index("100mbit")] = args.rate
                done = subprocess.run(tc, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"tbf could not be added: {done.stderr.strip()}")
        sampler = LoSampler()
        sampler.start()
        t_start = time.time()
        try:
            if args._case.startswith("collab-"):
                res = run_collab(args._case, args, work)
            else:
                res = run_hivemind(args._case.removeprefix("hivemind-"), args, work)
        finally:
            samples = sampler.stop()
        result.update(res)
        result["case_s"] = time.time() - t_start
        result["wire_bytes_per_peer"] = (samples[-1][1] - samples[0][1]) / PEERS
        if "t0" in res:
            t0 = res["t0"]
            result["curve"] = [
                (dt, step, loss, bytes_at(samples, t0 + dt) / PEERS) for dt, step, loss in res["curve"]
            ]
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        if not args._shared_net:
            sweep_namespace()
        (work / "result.json").write_text(json.dumps(result))


# ---------------------------------------------------------------- the driver


def namespaces_work() -> str | None:
    """None when ``unshare --net`` works here, else why not."""
    try:
        done = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare unavailable ({e})"
    return None if done.returncode == 0 else f"unshare --net failed: {done.stderr.strip()}"


def launch(case: str, capped: bool, args: argparse.Namespace, root: Path, shared_net: bool) -> dict[str, Any]:
    work = root / ("capped" if capped else "loopback") / case
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_case", case, "--_workdir", str(work)]
    cmd += ["--steps", str(args.steps), "--powersgd-rank", str(args.powersgd_rank), "--rate", args.rate]
    cmd += ["--matchmaking-time", str(args.matchmaking_time), "--refresh-period", str(args.refresh_period)]
    cmd += ["--case-timeout", str(args.case_timeout)]
    cmd += ["--_capped"] * capped + ["--_shared-net"] * shared_net
    if not shared_net:
        cmd = ["unshare", "--net", "--", *cmd]
    print(f"  {case} ({'capped' if capped else 'loopback'}) ...", end="", file=sys.stderr, flush=True)
    proc = start(cmd, work / "case.log", cwd=REPO)
    try:
        proc.wait(timeout=args.case_timeout + 300)
    except subprocess.TimeoutExpired:
        pass
    finally:
        stop(proc, wait_s=60)  # SIGTERM: the case stops its peers and sweeps its namespace
    try:
        res = json.loads((work / "result.json").read_text())
    except (OSError, ValueError):
        res = {"case": case, "capped": capped, "error": f"no result (see {work}/case.log)"}
    status = res.get("broken") or res.get("error") or f"loss {res['final_loss']:.4f}"
    print(f" {status}", file=sys.stderr, flush=True)
    return res


def first_reach(res: dict[str, Any], target: float) -> tuple[float, float, int] | None:
    """(seconds, wire bytes per peer, step) when the case's loss first came within REACH_TOL of ``target``."""
    for dt, step, loss, nbytes in res.get("curve", []):
        if loss is not None and loss <= target + REACH_TOL:
            return dt, nbytes, step
    return None


def _ratio(q: float) -> str:
    return f"{q:.3f} (1/{1 / q:.1f})" if q < 1 else f"{q:.2f}"


def table(results: list[dict[str, Any]], capped: bool) -> tuple[str, dict[str, Any]]:
    """The markdown table of one run and a summary (hivemind's best case, per-case ratios)."""
    ok = [r for r in results if "final_loss" in r]
    hm = [r for r in ok if r["case"].startswith("hivemind-")]
    best = min(hm, key=lambda r: r["final_loss"]) if hm else None
    reach = "time to hivemind-best loss" if capped else "reached hivemind-best loss?"
    equal = "hivemind best at this loss" + (" (time)" if capped else " (its MB; this case's bytes vs those)")
    lines = [
        f"| case | final eval loss | wire MB per peer | wall-clock s | samples per peer | "
        f"bytes vs hivemind best | {reach} | {equal} |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    info: dict[str, Any] = {"hivemind_best": best["case"] if best else None, "cases": {}}
    for r in results:
        name = r["case"]
        if "final_loss" not in r:
            lines.append(f"| {name} | {r.get('broken') or r.get('error')} | - | - | - | - | - | - |")
            continue
        spread = max(r["peer_losses"]) - min(r["peer_losses"])
        loss = f"{r['final_loss']:.4f}" + (f" (peers ±{spread / 2:.4f})" if spread > 1e-4 else "")
        row: dict[str, Any] = {"final_loss": r["final_loss"], "wire_bytes_per_peer": r["wire_bytes_per_peer"]}
        ratio = hit_text = eq_text = "-"
        if best is not None:
            row["bytes_vs_best"] = q = r["wire_bytes_per_peer"] / best["wire_bytes_per_peer"]
            ratio = "1 (best)" if r is best else _ratio(q)
            hit = first_reach(r, best["final_loss"])
            row["reached_best_loss"] = hit
            if hit is None:
                hit_text = f"no (+{r['final_loss'] - best['final_loss']:.4f})"
            elif capped:
                hit_text = f"{hit[0]:.1f} s (step {hit[2]})"
            else:
                hit_text = f"yes, step {hit[2]}, {hit[1] / 1e6:.2f} MB"
            twin = first_reach(best, r["final_loss"])
            row["best_at_this_loss"] = twin
            if twin is not None and twin[2] == 0 and r is not best:
                eq_text = "not below the initial loss"
            elif twin is not None and r is not best:
                if capped:
                    eq_text = f"{twin[0]:.1f} s (step {twin[2]})"
                else:
                    row["bytes_vs_best_at_equal_loss"] = e = r["wire_bytes_per_peer"] / max(twin[1], 1.0)
                    eq_text = f"step {twin[2]}, {twin[1] / 1e6:.2f} MB; {_ratio(e)}"
        info["cases"][name] = row
        lines.append(
            f"| {name} | {loss} | {r['wire_bytes_per_peer'] / 1e6:.2f} | {r['train_s']:.1f} | "
            f"{r['samples_per_peer']:.0f} | {ratio} | {hit_text} | {eq_text} |"
        )
    return "\n".join(lines), info


def case_notes(results: list[dict[str, Any]]) -> list[str]:
    """One line per case on how its run went (group sizes, downloads, refreshes)."""
    out = []
    for r in results:
        if "final_loss" not in r:
            continue
        if r["case"].startswith("hivemind-"):
            out.append(
                f"{r['case']}: {r['rounds_full_group']}/{PEERS * r['epochs']} gradient averagings with all "
                f"{PEERS} peers, {r['rounds_local_only']} with local gradients only, {r['state_downloads']} "
                f"state downloads, {r['extra_batches']} extra minibatches, peers' parameters differ by up "
                f"to {r['max_param_diff']:.2g}"
            )
        else:
            out.append(
                f"{r['case']}: {r['refreshes']} reference refreshes (dense rounds) besides the first, "
                f"identical state hash on all peers: {r['same_state']}; collab's own payload counter "
                f"{r['collab_wire_bytes_per_peer'] / 1e6:.2f} MB per peer (sent + received)"
            )
    return out


def plot(path: str, runs: dict[str, list[dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("loopback", 3, "wire MB per peer (loopback, log scale)", 1e6)]
    if runs.get("capped"):
        panels.append(("capped", 0, "wall-clock s (100 Mbit/s link)", 1.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, (key, col, xlabel, scale) in zip(axes[0], panels, strict=True):
        for r in runs[key]:
            pts = [p for p in r.get("curve", []) if p[2] is not None]
            if pts:
                style = "-" if r["case"].startswith("collab") else "--"
                ax.plot([p[col] / scale for p in pts], [p[2] for p in pts], style, label=r["case"])
        done = [r for r in runs[key] if r["case"].startswith("hivemind-") and "final_loss" in r]
        if done:
            best = min(r["final_loss"] for r in done)
            ax.axhline(best, color="grey", linestyle=":", label=f"hivemind best final loss {best:.3f}")
            start = max(r["curve"][0][2] for r in done if r.get("curve"))
            ax.set_ylim(best - 0.15, start + 0.15)  # MASHA's warmup spikes would squash the rest
        if key == "loopback":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("char-LM, 3 peers: collab (MASHA) vs hivemind.Optimizer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=80, help="global steps (hivemind epochs) per case")
    p.add_argument("--cases", default="all", help=f"comma-separated, or 'all': {','.join(ALL_CASES)}")
    p.add_argument(
        "--capped",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run every case over a shaped loopback (default: on)",
    )
    p.add_argument("--rate", default="100mbit", help="tbf rate of the capped link")
    p.add_argument("--out", default="runs/vs_hivemind.json", help="JSON with every result and curve")
    p.add_argument("--plot", help="loss vs wire bytes (and vs time on the capped link) to this PNG")
    p.add_argument("--workdir", help="logs of every case (default: a new temp folder)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="rank of hivemind's PowerSGD")
    p.add_argument(
        "--matchmaking-time",
        type=float,
        default=0.5,
        help="hivemind's matchmaking_time, s: its floor on an epoch's time (hivemind suggests 3-5 s; "
        "0.5 s is collab's min_matchmaking_time_s in examples/charlm.yaml)",
    )
    p.add_argument(
        "--refresh-period",
        type=float,
        default=0.2,
        help="how often hivemind's ProgressTracker fetches the swarm's progress, s (hivemind: 0.5-10)",
    )
    p.add_argument("--case-timeout", type=float, default=600.0, help="give up a case after this long, s")
    for hidden in ("--_case", "--_workdir", "--_codec", "--_initial-peer"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--_hivemind-peer", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_capped", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_shared-net", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse()
    if args._hivemind_peer is not None:
        args.workdir, args.index, args.codec = args._workdir, args._hivemind_peer, args._codec
        args.initial_peer = args._initial_peer
        hivemind_peer(args)
        return
    if args._case:
        run_case(args)
        return
    cases = ALL_CASES if args.cases == "all" else [c.strip() for c in args.cases.split(",")]
    unknown = [c for c in cases if c not in ALL_CASES]
    if unknown:
        sys.exit(f"--cases: unknown {unknown}; choose from {ALL_CASES}")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="vs-hivemind-"))
    no_ns = namespaces_work()
    notes = []
    if no_ns:
        notes.append(
            f"network namespaces impossible here ({no_ns}): bytes are the host loopback's "
            "counters over each case, other traffic on this machine included; no capped run"
        )
    print(f"{len(cases)} cases, {args.steps} steps, logs in {root}", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {}
    for capped in [False, True] if args.capped and not no_ns else [False]:
        key = "capped" if capped else "loopback"
        runs[key] = [launch(c, capped, args, root, shared_net=bool(no_ns)) for c in cases]
    out: dict[str, Any] = {"steps": args.steps, "peers": PEERS, "cases": cases, "notes": notes, "runs": runs}
    print()
    for key, results in runs.items():
        title = "loopback, no bandwidth limit" if key == "loopback" else f"capped: tbf {args.rate}, MTU 1500"
        text, info = table(results, capped=key == "capped")
        out[f"{key}_summary"] = info
        print(f"### {title} ({args.steps} steps, {PEERS} peers, batch 16 each)\n\n{text}\n")
        for line in case_notes(results):
            print(f"- {line}")
        print()
    for n in notes:
        print(f"note: {n}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"results in {args.out}")
    if args.plot:
        plot(args.plot, runs)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
