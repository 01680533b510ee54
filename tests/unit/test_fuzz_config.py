"""Fuzzing the config loader: any input gives a valid RunConfig or a ConfigError of one-line problems.

``parse_config``, ``load_config`` and ``with_overrides`` get random and hostile input (random YAML text,
random nested values, valid configs with one field replaced by something hostile, huge and non-finite
numbers, deep nesting, unicode and control characters, very long strings). Never any other exception,
every problem is one short line that starts with the field (or file) it is about, and a config that
loads is really valid. ``collab validate`` on hostile files: exit 2, one line on stderr, no traceback.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collab.config import ConfigError, RunConfig, load_config, parse_config, with_overrides
from tests.conftest import CONFIGS, run_cli

FUZZ = settings(
    max_examples=100,
    deadline=10_000,  # ms per example (~1 ms is usual): a hang shows as a failure, even on a busy machine
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,  # the same examples on every run: a failure here is reproducible
)

BASES = [yaml.safe_load(p.read_text()) for p in sorted(CONFIGS.glob("*.yaml"))]
# A problem line: "field.path: message" (or "(top level): ...", or "FILE: ..."), short, one line.
PROBLEM = re.compile(r"^[^\n]{1,400}?: \S[^\n]*$")

HUGE_INTS = st.sampled_from([2**63, -(2**63) - 1, 10**100, 10**4000, -1, 0])
ODD_FLOATS = st.sampled_from([math.inf, -math.inf, math.nan, 1e308, -0.0, 5e-324, 1e-300])
ODD_TEXT = st.sampled_from(
    ["", "\n", "a\nb", "\x00", "\u2028", "é" * 10, "🙂", "x" * 100_000, "${HOME}", "../../etc", "1e400"]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | HUGE_INTS
    | st.floats()
    | ODD_FLOATS
    | st.text(max_size=30)
    | ODD_TEXT
)
KEYS = st.text(max_size=12) | st.sampled_from(
    ["method", "task", "swarm", "name", "gamma", "seed", "ratio", "a\nb", "x" * 5000]
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=20,
)


def deep(depth: int, leaf: Any = 1) -> Any:
    out = leaf
    for i in range(depth):
        out = {"a": out} if i % 2 else [out]
    return out


def check_outcome(load: Any) -> RunConfig | None:
    """Run ``load()``: a valid RunConfig, or a ConfigError of well-formed lines; nothing else."""
    try:
        cfg = load()
    except ConfigError as e:
        assert e.problems, "a ConfigError lists its problems"
        for line in e.problems:
            assert PROBLEM.match(line), f"not one line naming a field: {line[:300]!r}"
            assert len(line) <= 500 and line.isprintable(), f"too long or unprintable: {line[:300]!r}"
        return None
    assert isinstance(cfg, RunConfig)
    dumped = cfg.model_dump(mode="json")
    assert all(math.isfinite(v) for v in _floats(dumped)), "a config that loads holds finite numbers only"
    assert parse_config(json.loads(json.dumps(dumped))) == cfg, "a loaded config round-trips"
    assert re.fullmatch(r"[0-9a-f]{16}", cfg.version())
    return cfg


def _floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _floats(v)]
    if isinstance(value, list):
        return [f for v in value for f in _floats(v)]
    return []


@st.composite
def mutated_config(draw: st.DrawFn) -> dict[str, Any]:
    """A shipped config with one field (at any depth) replaced, removed, or given a hostile sibling."""
    data = json.loads(json.dumps(draw(st.sampled_from(BASES))))
    node = data
    while True:
        key = draw(st.sampled_from(sorted(node)))
        if isinstance(node[key], dict) and node[key] and draw(st.booleans()):
            node = node[key]
            continue
        break
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        node[key] = draw(VALUES)
    elif action == "delete":
        del node[key]
    else:
        node[draw(KEYS)] = draw(VALUES)
    return data


@FUZZ
@given(VALUES)
def test_parse_config_random_values(data: Any) -> None:
    check_outcome(lambda: parse_config(data))


@FUZZ
@given(mutated_config())
def test_parse_config_mutated_shipped_configs(data: dict[str, Any]) -> None:
    check_outcome(lambda: parse_config(data))


@FUZZ
@given(st.dictionaries(st.sampled_from(["method", "task", "swarm", "seed", "max_steps", "junk"]), VALUES))
def test_with_overrides_random_changes(changes: dict[str, Any]) -> None:
    base = load_config(CONFIGS / "demo.yaml")
    check_outcome(lambda: with_overrides(base, **changes))


YAML_TEXT = (
    st.text(max_size=200)
    | st.binary(max_size=200).map(lambda b: b.decode("latin-1"))
    | mutated_config().map(lambda d: yaml.safe_dump(d, allow_unicode=True))
    | st.tuples(mutated_config(), st.integers(0, 400), st.text(min_size=1, max_size=5)).map(
        lambda t: _splice(yaml.safe_dump(t[0]), t[1], t[2])
    )
    | st.sampled_from(
        [
            "seed: " + "9" * 5000,  # more digits than Python converts to int
            "seed: 2001-13-45",  # looks like a date YAML must construct
            "a: " + "[" * 5000 + "]" * 5000,  # deep nesting
            "method: " + "{a: " * 2000 + "1" + "}" * 2000,
            "a: &a [1, 2]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\n",  # aliases
            "!!python/object/apply:os.system ['true']",
            "method: {gamma: .inf}",
            "method: {gamma: .nan}",
            "\ufeffmethod: {gamma: 0.1}",
            "? [1, 2]\n: 3",
            "<<: *x",
            "--- 1\n--- 2\n",
            "%YAML 9.9\n---\na: 1",
        ]
    )
)


def _splice(text: str, at: int, insert: str) -> str:
    at = min(at, len(text))
    return text[:at] + insert + text[at:]


@settings(FUZZ, max_examples=150)
@given(YAML_TEXT)
def test_load_config_random_yaml_text(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    check_outcome(lambda: load_config(path))


@pytest.mark.parametrize("depth", [50, 1000, 100_000])
def test_deep_nesting_is_a_config_error(depth: int) -> None:
    for data in ({"method": deep(depth)}, {"method": {"gamma": 0.1}, "compare": deep(depth)}, deep(depth)):
        assert check_outcome(lambda d=data: parse_config(d)) is None


def test_non_finite_numbers_are_refused_everywhere() -> None:
    base = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    for section, field in [("method", "gamma"), ("task", "reg_lambda"), ("swarm", "matchmaking_timeout_s")]:
        for bad in (math.inf, -math.inf, math.nan):
            data = json.loads(json.dumps(base))
            data[section][field] = bad
            with pytest.raises(ConfigError) as e:
                parse_config(data)
            problem = e.value.problems[0]  # (task problems name the task too: task.bilinear.reg_lambda)
            assert problem.startswith(f"{section}.") and f".{field}: " in problem, e.value.problems


def test_hostile_keys_and_values_stay_on_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"method": {"gamma": 0.1}, "a\nb\u2028c": 1, "task": {"name": "x\n" * 50_000}})
    assert all(PROBLEM.match(p) and len(p) <= 500 for p in e.value.problems), e.value.problems
    assert any(p.startswith("a\\nb\\u2028c:") for p in e.value.problems)


HOSTILE_FILES = {
    "digits.yaml": "method: {gamma: 0.1}\nseed: " + "9" * 5000 + "\n",
    "date.yaml": "method: {gamma: 0.1}\nseed: 2001-13-45\n",
    "deep.yaml": "method: " + "[" * 5000 + "]" * 5000 + "\n",
    "binary.yaml": "\udcff\udcfe\x00garbage",
    "inf.yaml": "method: {gamma: .inf}\n",
    "key.yaml": 'method: {gamma: 0.1}\n"bad\\nkey": 1\n',
    "tag.yaml": "!!python/object/apply:os.system ['true']\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_validate_cli_on_hostile_files(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(HOSTILE_FILES[name], encoding="utf-8", errors="surrogateescape")
    res = run_cli("validate", str(path), timeout=60)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(str(path)), res.stderr
    assert res.stdout == ""
