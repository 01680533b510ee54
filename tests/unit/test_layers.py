"""The folder tree is the architecture: imports flow one way (STYLE.md rule 1)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

NETWORKING = (
    "hivemind",
    "collab.swarm",
    "peers",
    "monitor",
    "socket",
    "http",
    "urllib",
    "fastapi",
    "uvicorn",
)
MATH_CORE = ("collab/compression", "collab/methods", "collab/tasks")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _offending(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    return bad


def test_math_core_never_imports_networking() -> None:
    for folder in MATH_CORE:
        assert _offending(folder, NETWORKING) == []


def test_lower_layers_never_import_upper_ones() -> None:
    assert _offending("collab/compression", ("collab.methods", "collab.tasks", "collab.config")) == []
    assert _offending("collab/tasks", ("collab.methods", "collab.compression")) == []
    assert _offending("collab", ("peers", "monitor")) == []
    # the applications never import each other's insides: what both need (HTTP limits) is in collab
    assert _offending("monitor", ("peers",)) == []


def test_only_swarm_imports_hivemind() -> None:
    for folder in ("collab", "peers", "monitor"):
        bad = [line for line in _offending(folder, ("hivemind",)) if not line.startswith("collab/swarm/")]
        assert bad == []


def test_monitor_process_imports_no_torch() -> None:
    """`collab monitor` stays small (issue 5: < 200 MB): its whole import graph leaves torch out."""
    code = (
        "import sys\n"
        "from collab.swarm.reader import load_dht_modules\n"
        "load_dht_modules()\n"
        "import peers.cli, peers.monitor_peer, monitor.app, monitor.service, collab.swarm.records\n"
        "import collab.swarm.access, peers.access_client  # invite-only runs\n"
        "from hivemind.dht.node import DHTNode\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
