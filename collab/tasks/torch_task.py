"""Bring your own PyTorch model: a task built from a factory the volunteer has installed.

Knows PyTorch modules, data and the flat layout of parameters into ``z``; knows nothing of methods,
compression or networks. A config names the factory and its options::

    task: {name: torch, factory: "mypackage.tasks:make_model", options: {layers: 2}, batch_size: 16}

The factory is a function decorated with :func:`task_factory` that takes ``seed`` and the options as
keyword arguments and returns a :class:`TorchProblem`: the model (an ``nn.Module`` built from code or a
``transformers`` config; nothing may be downloaded), the loss of ``(model, batch, adversary)``, the data
of shard ``m`` of ``M``, how to collate examples into a batch, an evaluation batch and, for min-max
problems, which parameters or extra tensors the adversary (the max player) holds. Example::

    from collab.tasks import TorchProblem, task_factory

    @task_factory
    def make(*, seed: int, hidden: int = 64) -> TorchProblem:
        model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        xs, ys = make_data(seed)
        return TorchProblem(
            model=model,
            loss=lambda model, batch, adversary: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
            data=lambda shard, num_shards: list(zip(xs, ys))[shard::num_shards],
            collate=lambda examples, generator: tuple(torch.stack(t) for t in zip(*examples)),
            eval_batch=(xs[:256], ys[:256]),
        )

The factory is imported with ``importlib`` from the volunteer's own environment: a config can only name
code that is installed there, never fetch any, and a function that is not marked with
:func:`task_factory` is refused (a config cannot make a peer call an arbitrary installed function).

Layout of ``z``: the model's parameters in ``named_parameters()`` order, then the adversary's extra
tensors in the order given. The operator is ``F = grad`` on the min player's coordinates and ``-grad``
on the adversary's (the VI of ``min_theta max_adversary loss``); minimization has no adversary.
Batches are drawn from a generator seeded by ``(run seed, step, shard)``, so every evaluation is
reproducible and both points of a MASHA step see the same minibatch. The model runs in eval mode
(dropout off): ``F`` must be a function of ``z`` and the batch.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from collab.rng import torch_seed
from collab.tasks.base import LocalOperator, Segment, Task

FACTORY_MARK = "__collab_task_factory__"
Precision = str  # "fp32" | "bf16" | "fp16"
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Examples(Protocol):
    """A shard's examples: anything with ``len`` and integer indexing (a list, a tensor, a Dataset)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def task_factory(fn: Callable[..., TorchProblem]) -> Callable[..., TorchProblem]:
    """Mark ``fn`` as a task factory that configs may name (``task.factory: "module:fn"``)."""
    setattr(fn, FACTORY_MARK, True)
    return fn


@dataclass
class TorchProblem:
    """What a task factory returns.

    ``loss(model, batch, adversary)`` returns a scalar tensor; ``adversary`` maps the names of the
    adversary's extra tensors to their current values (empty for minimization). ``data(shard,
    num_shards)`` returns the examples of one shard (anything with ``len`` and indexing);
    ``collate(examples, generator)`` turns a list of examples into a batch (tensors, possibly in
    tuples/lists/dicts), drawing any randomness (masking, augmentation) from ``generator`` only.
    ``adversary_params`` names model parameters that the adversary holds; ``project_adversary`` maps the
    adversary's tensors (parameters and extra tensors, by name) onto its feasible set. ``decay(name,
    tensor)`` says whether weight decay applies to a min-player parameter (default: matrices only).
    """

    model: torch.nn.Module
    loss: Callable[[torch.nn.Module, Any, dict[str, torch.Tensor]], torch.Tensor]
    data: Callable[[int, int], Examples]
    collate: Callable[[list[Any], torch.Generator], Any]
    eval_batch: Any
    adversary: dict[str, torch.Tensor] = field(default_factory=dict)
    adversary_params: Sequence[str] = ()
    project_adversary: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    decay: Callable[[str, torch.Tensor], bool] | None = None


class FactoryError(ValueError):
    """A factory that cannot be used; the message is one line naming the field (``task.factory: ...``)."""


def load_factory(spec: str) -> Callable[..., TorchProblem]:
    """The function named by ``"package.module:function"``, imported from the installed packages."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(f"task.factory: {spec!r:.80} is not 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        raise FactoryError(
            f"task.factory: module {missing!r} is not installed here (install the package that provides "
            f"{module_name}; collab never fetches code)"
        ) from None
    except Exception as e:  # the user's module failed while importing: report it, do not crash
        raise FactoryError(f"task.factory: importing {module_name} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise FactoryError(f"task.factory: module {module_name} has no {attr!r}")
    if not callable(fn) or not getattr(fn, FACTORY_MARK, False):
        raise FactoryError(
            f"task.factory: {spec} is not a collab task factory (decorate it with @collab.tasks.task_factory)"
        )
    return fn


def build_problem(
    factory: str | Callable[..., TorchProblem], options: Mapping[str, Any], seed: int
) -> TorchProblem:
    """Call the factory with ``seed`` and ``options`` under a fixed torch seed (equal models on all peers)."""
    fn = load_factory(factory) if isinstance(factory, str) else factory
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed % 2**63)
        try:
            problem = fn(seed=seed, **dict(options))
        except TypeError as e:
            raise FactoryError(f"task.options: the factory does not accept them: {e}") from None
    if not isinstance(problem, TorchProblem):
        raise FactoryError(f"task.factory: returned {type(problem).__name__}, not a TorchProblem")
    return problem


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device`` (tuples, lists and dicts are walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class _Model:
    """One copy of the model on one device, with ``z`` loaded into it on demand."""

    def __init__(self, task: TorchTask, device: str) -> None:
        self.task, self.device = task, torch.device(device)
        self.model = copy.deepcopy(task.problem.model).to(self.device)
        self.model.eval()
        self.params = [p for _, p in self.model.named_parameters()]
        for p in self.params:
            p.requires_grad_(True)

    def load(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Write the parameters of ``z``; return the adversary's extra tensors (leaves, on device)."""
        t = self.task
        z = z.to(self.device)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(z[: t.n_params], self.params)
        out, offset = {}, t.n_params
        for name, shape in t.adversary_shapes.items():
            n = _numel(shape)
            out[name] = z[offset : offset + n].reshape(shape).clone().requires_grad_(True)
            offset += n
        return out

    def loss(self, batch: Any, adversary: dict[str, torch.Tensor]) -> torch.Tensor:
        precision = self.task.precision
        with torch.autocast(
            self.device.type, dtype=_AUTOCAST.get(precision, torch.float32), enabled=precision in _AUTOCAST
        ):
            loss = self.task.problem.loss(self.model, batch, adversary)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("the task's loss must return a scalar tensor")
        return loss.float().reshape(())

    def operator(self, z: torch.Tensor, batch: Any) -> tuple[torch.Tensor, float]:
        """``F(z)`` on ``batch`` (fp32 on the CPU) and the loss."""
        adversary = self.load(z)
        leaves = [*self.params, *adversary.values()]
        loss = self.loss(batch, adversary)
        scale = 1024.0 if self.task.precision == "fp16" else 1.0  # keeps fp16 gradients from underflowing
        grads = torch.autograd.grad(loss * scale, leaves, allow_unused=True)
        flat = []
        for leaf, g, negate in zip(leaves, grads, self.task.adversary_flags, strict=True):
            g = torch.zeros_like(leaf) if g is None else g.float() / scale
            flat.append(-g.reshape(-1) if negate else g.reshape(-1))
        return torch.cat(flat).float().cpu(), float(loss.detach())


def _numel(shape: torch.Size) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class TorchOperator(LocalOperator):
    """Shard ``index``'s operator: gradients of the loss on a minibatch of the shard."""

    def __init__(self, task: TorchTask, index: int, device: str) -> None:
        self.task, self.index, self.dim = task, index, task.dim
        self.examples = task.problem.data(index, task.num_devices)
        if len(self.examples) == 0:
            raise ValueError(f"shard {index} of {task.num_devices} is empty")
        self.model = _Model(task, device)
        self.last_loss = float("nan")

    @property
    def weight(self) -> float:
        return float(self.task.batch_size)

    def batch(self, step: int, size: int, microbatch: int = 0) -> Any:
        # microbatch 0 is the step's minibatch of old (runs and their simulations keep their bits)
        what = "torch-batch" if microbatch == 0 else f"torch-batch-{microbatch}"
        g = torch.Generator().manual_seed(torch_seed(self.task.seed, step, what, self.index))
        pick = torch.randint(len(self.examples), (size,), generator=g).tolist()
        return self.task.problem.collate([self.examples[i] for i in pick], g)

    def evaluate(
        self, points: Sequence[torch.Tensor], *, step: int, full: bool = False, microbatch: int = 0
    ) -> list[torch.Tensor]:
        size = self.task.batch_size * (4 if full else 1)
        batch = to_device(self.batch(step, size, microbatch), self.model.device)
        out = []
        for p in points:
            f, self.last_loss = self.model.operator(p, batch)
            out.append(f)
        return out


class TorchTask(Task):
    """``TorchTask(factory="pkg.mod:fn", options={...}, num_devices=M, seed=s, batch_size=B)``."""

    metric_name = "loss"

    def __init__(
        self,
        *,
        factory: str | Callable[..., TorchProblem],
        options: Mapping[str, Any] | None = None,
        num_devices: int,
        seed: int,
        batch_size: int,
        device: str = "cpu",
        precision: Precision = "fp32",
    ) -> None:
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, not {precision!r}")
        self.num_devices, self.seed, self.batch_size = num_devices, seed, batch_size
        self.device, self.precision = device, precision
        self.problem = build_problem(factory, options or {}, seed)
        named = list(self.problem.model.named_parameters())
        names = {n for n, _ in named}
        unknown = [n for n in self.problem.adversary_params if n not in names]
        if unknown:
            raise FactoryError(f"task.factory: adversary_params names no parameter of the model: {unknown}")
        held = set(self.problem.adversary_params)
        self.param_names = [n for n, _ in named]
        self.n_params = sum(p.numel() for _, p in named)
        self.adversary_shapes = {k: v.shape for k, v in self.problem.adversary.items()}
        self.adversary_flags = [n in held for n, _ in named] + [True] * len(self.adversary_shapes)
        decay = self.problem.decay or (lambda name, p: p.ndim >= 2)
        self._segments = [Segment(n, p.numel(), decay=n not in held and decay(n, p)) for n, p in named]
        self._segments += [Segment(k, _numel(s), decay=False) for k, s in self.adversary_shapes.items()]
        self.dim = sum(s.size for s in self._segments)
        self._eval = _Model(self, "cpu")

    @property
    def minimization(self) -> bool:
        return not any(self.adversary_flags)

    def initial_point(self) -> torch.Tensor:
        parts = [p.detach().reshape(-1).float() for _, p in self.problem.model.named_parameters()]
        parts += [t.detach().reshape(-1).float() for t in self.problem.adversary.values()]
        return torch.cat(parts).clone()

    def local_operator(self, index: int) -> TorchOperator:
        return TorchOperator(self, index, self.device)

    def segments(self) -> list[Segment]:
        return list(self._segments)

    def project(self, z: torch.Tensor) -> torch.Tensor:
        """The adversary's tensors onto its feasible set (``project_adversary``); the rest unchanged."""
        fn = self.problem.project_adversary
        if fn is None or not any(self.adversary_flags):
            return z
        names = [s.name for s in self._segments]
        views = dict(zip(names, torch.split(z, [s.size for s in self._segments]), strict=True))
        adversary = {n: views[n] for n, a in zip(names, self.adversary_flags, strict=True) if a}
        projected = fn(dict(adversary))
        if all(projected[k] is v for k, v in adversary.items()):
            return z
        return torch.cat([projected.get(n, v).reshape(-1).float() for n, v in views.items()])

    def unflatten(self, z: torch.Tensor) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """The model (on the CPU, eval mode) holding ``z``'s parameters, and the adversary's tensors."""
        adversary = self._eval.load(z)
        return self._eval.model, {k: v.detach() for k, v in adversary.items()}

    def metric(self, z: torch.Tensor) -> float:
        """The loss on the evaluation batch at ``z`` (under the current adversary)."""
        with torch.no_grad():
            adversary = {k: v.detach() for k, v in self._eval.load(z).items()}
            return float(self._eval.loss(self.problem.eval_batch, adversary))
