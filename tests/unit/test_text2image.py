"""The text-to-image task: the scene generator, the checker, the model's layout and `collab generate`."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from PIL import Image

from collab.config import RunConfig, parse_config
from collab.methods.build import build_method
from collab.methods.checkpoint import encode_checkpoint
from collab.methods.simulated import SimulatedAggregator
from collab.tasks import scenes, text2image
from collab.tasks.build import build_task
from collab.tasks.torch_task import TorchTask
from peers.cli import main


def test_generator_is_a_function_of_the_seed() -> None:
    assert scenes.scenes(7, 200) == scenes.scenes(7, 200)
    assert scenes.scenes(7, 200) != scenes.scenes(8, 200)
    assert scenes.scenes(7, 50, held_out=True) == scenes.scenes(7, 50, held_out=True)
    p = text2image.text2image(seed=3, layers=1, hidden=16, heads=2, train_scenes=40, eval_scenes=4)
    q = text2image.text2image(seed=3, layers=1, hidden=16, heads=2, train_scenes=40, eval_scenes=4)
    assert torch.equal(p.data(1, 3), q.data(1, 3)) and len(p.data(0, 2)) == 20
    for a, b in zip(p.model.parameters(), q.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_held_out_pairs_never_reach_training() -> None:
    train = scenes.scenes(0, 6000)
    pairs = {(o.colour, o.shape) for s in train for o in s.objects}
    assert not pairs & scenes.HELD_OUT, "a held-out pair leaked into training"
    assert {c for c, _ in pairs} == set(scenes.COLOURS) and {s for _, s in pairs} == set(scenes.SHAPES), (
        "every colour and every shape is seen in training (composition, not novelty)"
    )
    held = scenes.scenes(0, 500, held_out=True)
    assert all(s.held_out for s in held)
    assert {(o.colour, o.shape) for s in held for o in s.objects} >= scenes.HELD_OUT
    # the model's training rows are exactly the training scenes
    p = text2image.text2image(seed=0, layers=1, hidden=16, heads=2, train_scenes=300, eval_scenes=4)
    rows = torch.cat([p.data(m, 3) for m in range(3)])
    assert len(rows) == 300
    expected = {tuple(text2image.encode(s).tolist()) for s in scenes.scenes(0, 300)}
    assert {tuple(r.tolist()) for r in rows} == expected


def test_checker_reads_back_every_attribute() -> None:
    everything = scenes.scenes(1, 3000) + scenes.scenes(1, 1000, held_out=True)
    for s in everything:
        image = scenes.render(s)
        assert scenes.read_scene(image) == s
        assert scenes.parse_caption(s.caption()) == s
        score = scenes.Score()
        score.add(s, image)
        assert score.rates() == {"background": 1, "colour": 1, "shape": 1, "position": 1, "exact_scene": 1}
    # one stray cell inside an object's quadrant is still that object; a wrong colour or shape is not
    rng = random.Random(0)
    s = scenes.Scene(
        "black", (scenes.Obj("red", "ring", "top left"), scenes.Obj("blue", "bar", "bottom right"))
    )
    image = scenes.render(s)
    stray = list(image)
    stray[1 * 8 + 1] = scenes.PALETTE.index("red")  # inside the ring
    assert scenes.read_scene(stray) == s
    recoloured = [scenes.PALETTE.index("green") if t == scenes.PALETTE.index("red") else t for t in image]
    score = scenes.Score()
    score.add(s, recoloured)
    assert score.rates() == {"background": 1, "colour": 0.5, "shape": 1, "position": 1, "exact_scene": 0}
    other = scenes.render(scenes.Scene("black", (scenes.Obj("red", "cross", "top left"), s.objects[1])))
    score = scenes.Score()
    score.add(s, other)
    assert score.rates()["shape"] == 0.5 and score.rates()["exact_scene"] == 0
    noise = [rng.randrange(len(scenes.PALETTE)) for _ in range(64)]
    assert scenes.read_scene(noise) is None
    # two defects make an object unreadable: no attribute of it counts, not even its position
    half = list(image)
    for r, c in [(0, 0), (0, 1)]:
        half[r * 8 + c] = scenes.PALETTE.index("blue")  # two ring cells in another colour
    crossish = list(image)
    crossish[0] = crossish[3] = scenes.PALETTE.index("black")  # a ring missing two corners
    for broken in (half, crossish):
        assert scenes.read_scene(broken) is None
        score = scenes.Score()
        score.add(s, broken)
        assert score.rates() == {
            "background": 1,
            "colour": 0.5,
            "shape": 0.5,
            "position": 0.5,
            "exact_scene": 0,
        }


def test_captions_outside_the_grammar_are_one_line() -> None:
    for bad, needle in [
        ("a purple ring top left on black", "unknown words ['purple']"),
        ("a red ring top left", "ends with 'on <background>'"),
        ("a red ring top middle on black", "unknown words ['middle']"),
        ("a red ring left top on black", "cannot read position"),
        ("a red ring top left and a blue bar top left on black", "different positions"),
    ]:
        with pytest.raises(scenes.CaptionError) as e:
            scenes.parse_caption(bad)
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_loss_is_on_image_tokens_only_and_sampling_stays_in_the_palette() -> None:
    p = text2image.text2image(seed=0, layers=1, hidden=16, heads=2, train_scenes=30, eval_scenes=4)
    batch = p.collate(list(p.data(0, 1)[:4]), torch.Generator())
    labels = batch["labels"]
    assert labels.shape == (4, text2image.SEQ_LEN)
    assert (labels[:, : text2image.IMAGE_START + 1] == -100).all()
    assert (labels[:, text2image.IMAGE_START + 1 :] >= text2image.PALETTE_BASE).all()
    model = p.model.eval()
    greedy = text2image.sample(model, "a red ring top left on black", n=2, temperature=0)
    assert greedy == text2image.sample(model, "a red ring top left on black", n=2, temperature=0)
    g = torch.Generator().manual_seed(1)
    drawn = text2image.sample(
        model, "a red ring top left on black", n=3, temperature=1.0, top_k=2, generator=g
    )
    assert len(drawn) == 3 and all(
        len(im) == 64 and all(0 <= t < len(scenes.PALETTE) for t in im) for im in drawn
    )
    one = text2image.sample(model, "a red ring top left on black", n=2, temperature=0.7, top_k=1, generator=g)
    assert one == greedy, "top-k 1 is the argmax"
    with pytest.raises(ValueError, match="temperature"):
        text2image.sample(model, "a red ring top left on black", n=1, temperature=float("inf"))


SMALL = {
    "run_id": "t2i-small",
    "seed": 0,
    "num_devices": 2,
    "max_steps": 30,
    "task": {
        "name": "text2image",
        "batch_size": 16,
        "layers": 1,
        "hidden": 32,
        "heads": 2,
        "train_scenes": 400,
    },
    "method": {
        "name": "masha2",
        "gamma": 0.01,
        "tau": 0.9,
        "device_compressor": {"name": "topk", "ratio": 0.1},
        "optimizer": {"name": "adam", "clip_norm": 1.0},
    },
}


def _trained(steps: int) -> tuple[RunConfig, TorchTask, list[float], torch.Tensor, bytes]:
    cfg = parse_config({**SMALL, "max_steps": steps})
    task = build_task(cfg)
    assert isinstance(task, TorchTask)
    method = build_method(cfg, task, SimulatedAggregator(num_devices=2), range(2))
    method.initialize()
    losses = [task.metric(method.state.z)]
    for _ in range(steps):
        method.step()
        losses.append(task.metric(method.state.z))
    data = encode_checkpoint(method.state, config_version=cfg.version(), method=cfg.method.name, config=cfg)
    return cfg, task, losses, method.state.z, data


def test_training_lowers_the_image_loss_and_generate_draws_a_grid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, task, losses, z, data = _trained(25)
    assert losses[-1] < 0.6 * losses[0], losses[::5]
    ckpt = tmp_path / "run.ckpt"
    ckpt.write_bytes(data)
    out = tmp_path / "grid.png"
    prompt = "a red ring top left and a blue bar bottom right on black"
    rc = main(["generate", "--checkpoint", str(ckpt), "--prompt", prompt, "--n", "8", "--temperature", "0",
               "--out", str(out)])  # fmt: skip
    stdout = capsys.readouterr().out
    assert rc == 0 and f"8 samples of {prompt!r} from step 25" in stdout
    grid = Image.open(out)
    assert grid.format == "PNG" and grid.size == (8 * 66 + 2, 66 + 2)
    model, _ = task.unflatten(z)
    expected = text2image.sample(model, prompt, n=1, temperature=0)[0]
    tile = grid.crop((2, 2, 66, 66)).resize((8, 8), Image.Resampling.NEAREST)
    assert list(tile.getdata()) == [scenes.RGB[scenes.PALETTE[t]] for t in expected], (
        "the grid shows the checkpoint's model's samples"
    )


def test_generate_refuses_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_config(SMALL)
    task = build_task(cfg)
    state = build_method(cfg, task, SimulatedAggregator(num_devices=2), range(2))
    state.initialize()
    ckpt = tmp_path / "run.ckpt"
    ckpt.write_bytes(
        encode_checkpoint(state.state, config_version=cfg.version(), method=cfg.method.name, config=cfg)
    )
    cases = [
        (["--prompt", "a purple ring top left on black"], "--prompt: unknown words ['purple']"),
        (
            ["--prompt", "a red ring top left on black", "--temperature", "inf"],
            "--temperature must be a finite",
        ),
        (
            ["--prompt", "a red ring top left on black", "--temperature", "nan"],
            "--temperature must be a finite",
        ),
        (["--prompt", "a red ring top left on black", "--seed", str(2**70)], "--seed must be between"),
        (["--prompt", "a red ring top left on black", "--n", "0"], "--n must be between 1 and 256"),
        (["--prompt", "a red ring top left on black", "--top-k", "0"], "--top-k must be at least 1"),
    ]
    for extra, needle in cases:
        rc = main(["generate", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x.png"), *extra])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and err.count("\n") == 1, err
    # a checkpoint of another task, and an --out that is a folder (found after sampling)
    other = parse_config(
        {**SMALL, "task": {"name": "bilinear", "dim": 4}, "method": {"name": "extragradient", "gamma": 0.1}}
    )
    bil = build_method(other, build_task(other), SimulatedAggregator(num_devices=2), range(2))
    bil.initialize()
    assert bil.state is not None
    foreign = tmp_path / "bilinear.ckpt"
    foreign.write_bytes(
        encode_checkpoint(bil.state, config_version=other.version(), method="extragradient", config=other)
    )
    for ck, out, needle in [
        (foreign, tmp_path / "x.png", "is not of a text2image run (task bilinear)"),
        (ckpt, tmp_path, "cannot write"),  # --out names a folder
    ]:
        prompt = "a red ring top left on black"
        rc = main(["generate", "--checkpoint", str(ck), "--prompt", prompt, "--n", "1", "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and err.count("\n") == 1, err
    missing = str(tmp_path / "missing.ckpt")
    rc = main(
        ["generate", "--checkpoint", missing, "--prompt", "a red ring top left on black", "--out", "x.png"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "missing.ckpt" in err and err.count("\n") == 1, err
