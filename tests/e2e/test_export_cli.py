"""`collab export` as a user runs it (a separate process): a checkpoint of the char-LM example becomes a
folder that `from_pretrained` loads; a damaged checkpoint is one line on stderr, exit 2, no traceback.

The full behaviour (outputs equal to the checkpoint's, the adversary, plain state_dicts, each error) is
in tests/unit/test_export.py.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli
from tests.unit.test_export import CHARLM, _trained, _write


def test_export_cli(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    cfg, task, state = _trained(CHARLM, steps=1)
    ckpt = _write(tmp_path / "peer.ckpt", cfg, state)
    out = tmp_path / "model"
    res = run_cli("export", "--checkpoint", str(ckpt), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 1 and "GPT2LMHeadModel" in res.stdout
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert sum(p.numel() for p in loaded.parameters()) == task.n_params

    damaged = tmp_path / "damaged.ckpt"
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    res = run_cli("export", "--checkpoint", str(damaged), "--out", str(tmp_path / "nothing"))
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.splitlines() == [f"checkpoint {damaged} is corrupt (hash mismatch); not loaded"]
    assert not (tmp_path / "nothing").exists()
