"""The project's own quality gates, run by the test command: ruff (lint + format) and mypy on the code
users run (collab/, peers/, monitor/, examples/, and bench/ - checked apart: it has its own monitor.py)."""

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


@pytest.mark.parametrize("paths", [("collab", "peers", "monitor", "examples"), ("bench",)], ids=str)
def test_mypy_clean(paths: tuple[str, ...]) -> None:
    pytest.importorskip("mypy")
    res = _run(sys.executable, "-m", "mypy", *paths)
    assert res.returncode == 0, res.stdout + res.stderr


def test_readme_test_command_is_what_ci_runs() -> None:
    root = REPO
    first = (root / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert len(first) == 2 and "collab demo" in first[0], first
    test_command = first[1]
    ci = [x.strip() for x in (root / ".ci/run").read_text().splitlines() if x.strip() and x[0] != "#"]
    assert test_command in ci, f"{test_command!r} is not what .ci/run calls: {ci}"
    script = (root / "tests/run.sh").read_text()
    assert "apt-get install -y -q chromium chromium-driver" in script, "the dashboard test needs chromium"
    assert "python -m pytest" in script and '"$rc" -eq 5' in script
