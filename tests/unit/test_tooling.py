"""The project's own quality gates, run by the test command: ruff (lint + format) and mypy on collab/."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff comes with the [dev] extra")
def test_ruff_clean() -> None:
    lint = _run("ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run("ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    res = _run(sys.executable, "-m", "mypy", "collab")
    assert res.returncode == 0, res.stdout + res.stderr
