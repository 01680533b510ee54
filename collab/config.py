"""RunConfig: the single, typed source of a run's settings (pydantic v2, frozen, no unknown keys).

Knows the settings and their validation; knows nothing of how they are used. Loaded from YAML or JSON
with :func:`load_config`; :func:`config_errors` turns a validation failure into one line per problem,
each naming the field (``method.gamma: ...``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

MethodName = Literal["extragradient", "masha1", "masha2"]
CompressorName = Literal["identity", "randk", "topk"]


class _Section(BaseModel):
    # allow_inf_nan=False: no setting means anything at infinity or NaN (gamma=.inf would pass gt=0)
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class CompressorConfig(_Section):
    """A compressor and its keep-ratio."""

    name: CompressorName = Field("identity", description="identity, randk (unbiased) or topk (contractive)")
    ratio: float = Field(
        1.0, gt=0, le=1, description="fraction k/d of coordinates kept (ignored by identity)"
    )
    coordinates: Literal["shared", "per_device"] = Field(
        "shared",
        description="randk only: 'shared' = every device keeps the same coordinates (seed, step), so the "
        "aggregate stays k-sparse; 'per_device' = independent coordinates per device (lower variance "
        "of the average, aggregate up to M*k entries)",
    )


class BilinearTaskConfig(_Section):
    """The paper's regularized bilinear saddle point split over devices (see docs/ALGORITHMS.md)."""

    name: Literal["bilinear"] = "bilinear"
    dim: int = Field(100, ge=1, le=100_000, description="dimension of x and of y (z has 2*dim coordinates)")
    reg_lambda: float = Field(0.1, gt=0, description="regularization lambda (strong monotonicity constant)")
    heterogeneity: float = Field(
        1.0, ge=0, description="scale of each device's deviation A_m - A from the shared matrix A"
    )
    init_scale: float = Field(1.0, gt=0, description="z^0 drawn from N(0, init_scale^2)")


class AdversarialTaskConfig(_Section):
    """Adversarial training of a small ALBERT-like masked LM (see collab/tasks/adversarial.py)."""

    name: Literal["adversarial"] = "adversarial"
    seq_len: int = Field(32, ge=4, le=512, description="tokens (characters) per example")
    batch_size: int = Field(16, ge=1, le=4096, description="examples per device per step")
    embedding_size: int = Field(32, ge=4, le=1024, description="ALBERT embedding size")
    hidden_size: int = Field(64, ge=8, le=4096, description="transformer hidden size")
    layers: int = Field(2, ge=1, le=48, description="transformer layers")
    heads: int = Field(2, ge=1, le=64, description="attention heads (must divide hidden_size)")
    epsilon: float = Field(1.0, ge=0, description="radius of the input-embedding perturbation ball")
    mask_prob: float = Field(0.15, gt=0, lt=1, description="fraction of tokens masked for the MLM loss")

    @model_validator(mode="after")
    def _heads_divide(self) -> AdversarialTaskConfig:
        if self.hidden_size % self.heads:
            raise ValueError("heads must divide hidden_size")
        return self


class Text2ImageTaskConfig(_Section):
    """A DALL-E-like text-to-image transformer on generated captioned scenes (collab/tasks/text2image.py)."""

    name: Literal["text2image"] = "text2image"
    batch_size: int = Field(16, ge=1, le=4096, description="captioned images per device per step")
    layers: int = Field(3, ge=1, le=48, description="transformer layers")
    hidden: int = Field(96, ge=8, le=4096, description="transformer hidden size")
    heads: int = Field(4, ge=1, le=64, description="attention heads (must divide hidden)")
    train_scenes: int = Field(40000, ge=1, le=1_000_000, description="training scenes, all shards together")
    eval_scenes: int = Field(64, ge=1, le=10_000, description="scenes in the evaluation batch of the loss")
    prompts: list[Annotated[str, Field(max_length=200)]] = Field(
        default_factory=list, max_length=64, description="prompts of the run's sample gallery"
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> Text2ImageTaskConfig:
        if self.hidden % self.heads:
            raise ValueError("heads must divide hidden")
        return self


FACTORY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class TorchTaskConfig(_Section):
    """A PyTorch model of the organizer's own (see collab/tasks/torch_task.py and the README's "Train your
    own model"): a factory in code every volunteer has installed, called with ``options``."""

    name: Literal["torch"] = "torch"
    factory: str = Field(
        ...,
        max_length=200,
        description="'package.module:function' returning a TorchProblem, importable on every peer "
        "(never fetched: volunteers install the package themselves)",
    )
    options: dict[str, JsonValue] = Field(
        default_factory=dict, description="keyword arguments of the factory (plain JSON values)"
    )
    batch_size: int = Field(16, ge=1, le=65536, description="examples per device per step")

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, v: str) -> str:
        if not re.match(FACTORY_PATTERN, v):
            raise ValueError(f"must be 'package.module:function' (got {_one_line(v, 60)!r})")
        return v


TaskConfig = Annotated[
    BilinearTaskConfig | AdversarialTaskConfig | Text2ImageTaskConfig | TorchTaskConfig,
    Field(discriminator="name"),
]


class ScheduleConfig(_Section):
    """The stepsize as a function of the step: ``gamma * factor(step)``."""

    name: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="constant, or cosine / linear decay to min_ratio after the warmup"
    )
    warmup_steps: int = Field(0, ge=0, description="linear warmup from gamma/warmup_steps to gamma")
    min_ratio: float = Field(0.0, ge=0, le=1, description="final stepsize as a fraction of gamma (decays)")
    total_steps: int | None = Field(
        None, ge=1, description="step at which the decay ends (null: the run's max_steps)"
    )


class OptimizerConfig(_Section):
    """The update applied to the group's aggregate direction (collab/methods/optimizers.py)."""

    name: Literal["sgd", "adam", "adamw", "lamb"] = Field(
        "sgd", description="sgd (the paper's update), adam, adamw (decoupled decay) or lamb (trust ratios)"
    )
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment decay (adaptive optimizers)")
    beta2: float = Field(0.999, ge=0, lt=1, description="second-moment decay (adaptive optimizers)")
    eps: float = Field(1e-8, gt=0, le=1, description="added to the preconditioner's denominator")
    weight_decay: float = Field(0.0, ge=0, le=1, description="weight decay (not on biases, norms, adversary)")
    clip_norm: float | None = Field(
        None, gt=0, description="clip the aggregate direction to this Euclidean norm (null: no clipping)"
    )
    schedule: ScheduleConfig = Field(
        default_factory=lambda: ScheduleConfig(), description="the stepsize schedule"
    )


class MethodConfig(_Section):
    """Which method runs and its parameters (MASHA.md notation)."""

    name: MethodName = Field("masha1", description="extragradient, masha1 (unbiased) or masha2 (contractive)")
    gamma: float = Field(..., gt=0, description="stepsize gamma")
    tau: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="MASHA tau: the reference point is refreshed with probability 1 - tau; "
        "null = 1 - k/d of the device compressor (balances compressed and full exchanges)",
    )
    anchor: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="MASHA's pull toward the reference point each step: zbar = (1 - anchor) z + anchor w; "
        "null = 1 - tau, as analysed; 0 = no pull (outside the analysis; faster early under light "
        "compression, worse under heavy compression and in long runs: docs/ALGORITHMS.md)",
    )
    device_compressor: CompressorConfig = Field(
        default_factory=lambda: CompressorConfig(),
        description="compressor applied by each device to its message",
    )
    server_compressor: CompressorConfig = Field(
        default_factory=lambda: CompressorConfig(), description="compressor applied to the group's aggregate"
    )
    optimizer: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(),
        description="update rule on the aggregate (gamma is its base stepsize / learning rate)",
    )

    @model_validator(mode="after")
    def _compressors_fit_method(self) -> MethodConfig:
        dev, srv = self.device_compressor.name, self.server_compressor.name
        if self.name == "extragradient" and (dev, srv) != ("identity", "identity"):
            raise ValueError("extragradient is the uncompressed baseline: both compressors must be identity")
        if self.name == "extragradient" and self.anchor is not None:
            raise ValueError("anchor is MASHA's: extragradient has no reference point")
        if self.name == "masha1" and "topk" in (dev, srv):
            raise ValueError("masha1 needs unbiased compressors (identity or randk); use masha2 for topk")
        if self.name == "masha2" and "randk" in (dev, srv):
            raise ValueError("masha2 needs contractive compressors (identity or topk); use masha1 for randk")
        return self

    def effective_tau(self, numel: int) -> float:
        """tau, or its default ``1 - k/d`` for the device compressor on a ``numel``-vector."""
        if self.tau is not None:
            return self.tau
        if self.device_compressor.name == "identity":
            return 0.5
        k = min(numel, max(1, round(self.device_compressor.ratio * numel)))
        return 1.0 - k / numel


class SwarmConfig(_Section):
    """How peers form groups and exchange messages (all times in float seconds)."""

    min_group_size: int = Field(2, ge=1, description="a round with fewer members fails and is retried")
    target_group_size: int | None = Field(
        None, ge=2, description="close a group as soon as it has this many members (null: all that came)"
    )
    min_matchmaking_time_s: float = Field(
        0.5, gt=0, description="how long a leader waits for announced peers before it closes the group"
    )
    matchmaking_timeout_s: float = Field(8.0, gt=0, description="give up forming a group after this long")
    allreduce_timeout_s: float = Field(
        10.0,
        gt=0,
        description="give up a round's exchange after this long, plus the time its bytes take at "
        "min_bandwidth_mb_s",
    )
    min_bandwidth_mb_s: float = Field(
        10.0,
        gt=0,
        description="the slowest link (MB/s) a round's exchange deadlines allow for: they grow by the "
        "round's bytes over this rate, or over the rate a peer measured when that is slower",
    )
    single_owner_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="a round whose messages, times its number of part owners, come to at most this many "
        "bytes goes through one owner (fewer calls: small rounds are set by latency, not bytes); 0: never",
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, description="how often a peer refreshes its alive record")
    heartbeat_ttl_s: float = Field(
        4.0, gt=0, description="an alive record older than this means the peer left"
    )
    suspect_ttl_s: float = Field(15.0, gt=0, description="how long a peer that failed a call is avoided")
    state_sync_timeout_s: float = Field(
        30.0, gt=0, description="time limit for one call of a state download (one chunk of the state)"
    )
    state_chunk_bytes: int = Field(
        8 * 1024**2,
        ge=1024,
        description="a state download moves the state in chunks of this many bytes, each checked as it "
        "arrives; one that breaks off resumes from the next chunk, from any peer holding the same state "
        "(at most max_message_bytes)",
    )
    max_norm_ratio: float = Field(
        10.0,
        gt=1,
        le=1e6,  # its square bounds bans: finite
        description="a contribution whose norm exceeds this multiple of the group's lower median is "
        "scaled down to it (in the simulation too); one over its square is dropped and its sender banned",
    )
    max_weight_ratio: float = Field(
        100.0,
        gt=1,
        description="a contribution claiming more samples than this multiple of the group's lower median "
        "is dropped (members of uneven speed claim different sample counts)",
    )
    round_time_s: float | None = Field(
        None,
        gt=0,
        description="compute budget of a round: each member evaluates as many microbatches at the round's "
        "points as fit in this many seconds of its time and is weighted by its samples, so fast machines "
        "contribute more and slow ones still take part (null: one microbatch per member, as collab "
        "simulate computes)",
    )
    target_batch_size: int | None = Field(
        None,
        ge=1,
        description="samples a round gathers across its group: members compute until the group's published "
        "rates say it has this many, at most round_time_s (null: each member computes for round_time_s)",
    )
    ban_duration_s: float = Field(
        600.0, gt=0, description="how long a peer that sent an invalid contribution is excluded from rounds"
    )
    max_message_bytes: int = Field(
        512 * 1024**2, ge=1024, description="largest message a peer accepts (bigger ones are refused)"
    )

    @model_validator(mode="after")
    def _timeouts_consistent(self) -> SwarmConfig:
        if self.min_matchmaking_time_s >= self.matchmaking_timeout_s:
            raise ValueError("min_matchmaking_time_s must be smaller than matchmaking_timeout_s")
        if self.heartbeat_interval_s >= self.heartbeat_ttl_s:
            raise ValueError("heartbeat_interval_s must be smaller than heartbeat_ttl_s")
        if self.target_batch_size is not None and self.round_time_s is None:
            raise ValueError("target_batch_size needs round_time_s (the longest a round stays open)")
        return self


class RunConfig(_Section):
    """Everything that defines a run. Every peer of a swarm must hold the same one (see ``version``)."""

    run_id: str = Field(
        "collab-run", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="run name"
    )
    seed: int = Field(0, ge=0, lt=2**63, description="seed of everything random that peers must agree on")
    task: TaskConfig = Field(default_factory=lambda: BilinearTaskConfig(), description="the problem to solve")
    method: MethodConfig = Field(..., description="the method and its compressors")
    num_devices: int = Field(4, ge=1, le=10_000, description="number of devices M (simulation)")
    max_steps: int = Field(1000, ge=1, description="number of steps to run")
    target_rel_distance: float = Field(
        1e-6, gt=0, description="target accuracy: squared distance to the solution relative to the start"
    )
    swarm: SwarmConfig = Field(
        default_factory=lambda: SwarmConfig(), description="group formation and exchange timeouts"
    )
    compare: list[MethodConfig] = Field(
        default_factory=list, description="methods run by `collab simulate --compare` (default: the method)"
    )
    access: Literal["open", "invite"] = Field(
        "open",
        description="open: anyone may join; invite: peers need an access token from the coordinator "
        "(collab join --token INVITE)",
    )
    access_token_ttl_s: float = Field(
        3600.0, ge=10, le=30 * 86400, description="lifetime of an access token (refreshed before expiry)"
    )

    @model_validator(mode="after")
    def _schedules_fit(self) -> RunConfig:
        named = [("method", self.method), *((f"compare.{i}", m) for i, m in enumerate(self.compare))]
        for where, mc in named:
            sched = mc.optimizer.schedule
            total = sched.total_steps
            # a schedule that follows max_steps may be cut short (a --max-steps 20 trial of a longer run
            # ends inside its warmup); one whose own total_steps leave no room after warmup is a mistake
            if total is not None and sched.warmup_steps and sched.warmup_steps >= total:
                raise ValueError(
                    f"{where}.optimizer.schedule.warmup_steps ({sched.warmup_steps}) must be smaller than "
                    f"the schedule's total steps ({total})"
                )
        if self.task.name == "text2image" and self.task.train_scenes < self.num_devices:
            raise ValueError(
                f"task.train_scenes ({self.task.train_scenes}) must be at least num_devices "
                f"({self.num_devices}): every device needs a shard"
            )
        return self

    def version(self) -> str:
        """A short hash of the canonical JSON form; equal configs have equal versions."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class ConfigError(ValueError):
    """A config that cannot be loaded; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _one_line(text: str, limit: int) -> str:
    """``text`` with control characters (newlines included) escaped, cut to ``limit`` characters: keys and
    values in messages come from the input, which may be hostile."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    return out if len(out) <= limit else out[: limit - 3] + "..."


def config_errors(err: ValidationError) -> list[str]:
    """One line per problem: ``field.path: message``."""
    lines = []
    for e in err.errors():
        loc = ".".join(
            _one_line(str(p), 80) for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))
        )
        msg = _one_line(e["msg"].removeprefix("Value error, "), 200)
        if not loc and re.match(r"[a-z_]+(\.[a-z0-9_]+)+ ", msg):
            lines.append(msg)  # a cross-field check that names its field itself
        else:
            lines.append(f"{loc or '(top level)'}: {msg}")
    return lines


def parse_config(data: Any) -> RunConfig:
    """Validate a mapping into a RunConfig, raising :class:`ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(["(top level): a config must be a mapping of fields"])
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(config_errors(e)) from None


def load_config(path: str | Path) -> RunConfig:
    """Load a YAML (or JSON) run config; raises :class:`ConfigError` with one line per problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, or a NUL in the path
        raise ConfigError([f"{p}: cannot read config ({e.__class__.__name__}: {e})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError([f"{p}: not valid YAML{at}"]) from None
    except RecursionError:
        raise ConfigError([f"{p}: not a config: nested too deeply"]) from None
    except ValueError as e:  # a scalar YAML cannot convert: a 5000-digit integer, a date like 2001-13-45
        raise ConfigError(
            [f"{p}: not valid YAML: a value cannot be read ({_one_line(str(e), 120)})"]
        ) from None
    return parse_config(data)


def with_overrides(cfg: RunConfig, **changes: Any) -> RunConfig:
    """A re-validated copy of ``cfg`` with nested changes, e.g. ``{"method": {"gamma": 0.1}}``."""

    def merge(base: dict[str, Any], upd: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, val in upd.items():
            out[key] = (
                merge(out[key], val) if isinstance(val, dict) and isinstance(out.get(key), dict) else val
            )
        return out

    return parse_config(merge(cfg.model_dump(mode="json"), changes))
