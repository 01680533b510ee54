"""The bring-your-own-model task API: factories, operators, precision, and the char-LM example training."""

from __future__ import annotations

import pytest
import torch

from collab.config import load_config, with_overrides
from collab.methods.simulation import simulate
from collab.tasks import TorchProblem, task_factory
from collab.tasks.torch_task import FactoryError, TorchTask, load_factory
from tests.conftest import REPO


@task_factory
def regression(*, seed: int, width: int = 16, n: int = 96) -> TorchProblem:
    """y = a two-layer net of x plus noise; the model is a fresh net of the same shape."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, 4, generator=g)
    ys = torch.tanh(xs @ torch.randn(4, 1, generator=g)) + 0.01 * torch.randn(n, 1, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    return TorchProblem(
        model=model,
        loss=lambda model, batch, adversary: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
        data=lambda shard, num_shards: list(zip(xs, ys, strict=True))[shard::num_shards],
        collate=lambda examples, generator: tuple(torch.stack(t) for t in zip(*examples, strict=True)),
        eval_batch=(xs, ys),
    )


def unmarked(*, seed: int) -> TorchProblem:  # not a factory: configs may not name it
    return regression(seed=seed)


def test_load_factory_imports_only_marked_functions() -> None:
    assert load_factory("examples.charlm:char_gpt").__name__ == "char_gpt"
    assert load_factory("tests.unit.test_torch_task:regression") is regression
    with pytest.raises(FactoryError, match=r"^task\.factory: .*is not a collab task factory"):
        load_factory("tests.unit.test_torch_task:unmarked")
    with pytest.raises(FactoryError, match=r"^task\.factory: module 'surely_absent_pkg' is not installed"):
        load_factory("surely_absent_pkg.models:build")
    with pytest.raises(FactoryError, match=r"^task\.factory: .* is not 'package.module:function'"):
        load_factory("examples.charlm")
    with pytest.raises(FactoryError, match=r"^task\.options: the factory does not accept them"):
        TorchTask(factory=regression, options={"depth": 3}, num_devices=2, seed=0, batch_size=8)


def test_same_seed_same_model_and_operator_is_the_gradient() -> None:
    a = TorchTask(factory=regression, num_devices=2, seed=5, batch_size=8)
    b = TorchTask(factory="tests.unit.test_torch_task:regression", num_devices=2, seed=5, batch_size=8)
    z = a.initial_point()
    assert torch.equal(z, b.initial_point()) and z.dtype == torch.float32
    op = a.local_operator(1)
    f = op.evaluate([z], step=3)[0]
    again = b.local_operator(1).evaluate([z], step=3)[0]
    assert torch.equal(f, again), "batches depend on (seed, step, shard) only"
    model, _ = a.unflatten(z)
    batch = op.batch(3, 8)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(f, expected)
    assert [s.decay for s in a.segments()] == [True, False, True, False], "weight decay on matrices only"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_keeps_the_state_fp32(precision: str) -> None:
    exact = TorchTask(factory=regression, num_devices=1, seed=1, batch_size=32)
    low = TorchTask(factory=regression, num_devices=1, seed=1, batch_size=32, precision=precision)
    z = exact.initial_point()
    f32 = exact.local_operator(0).evaluate([z], step=0)[0]
    f16 = low.local_operator(0).evaluate([z], step=0)[0]
    assert f16.dtype == torch.float32 and f16.device.type == "cpu"
    assert not torch.equal(f16, f32), "the operator really ran in reduced precision"
    assert (f16 - f32).norm() < 0.05 * f32.norm()
    with pytest.raises(ValueError, match="precision"):
        TorchTask(factory=regression, num_devices=1, seed=1, batch_size=8, precision="int8")


def test_char_lm_example_trains_and_its_loss_falls() -> None:
    cfg = load_config(REPO / "examples" / "charlm.yaml")
    cfg = with_overrides(cfg, max_steps=30)  # the example as shipped, shortened (warmup 20, then cosine)
    res = simulate(cfg, stop_at_target=False)
    losses = [row[3] for row in res.rows]
    assert res.steps == 30 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < 0.85 * losses[0], losses[::5]
    assert min(losses[-5:]) < min(losses[:5]), "still falling at the end"
