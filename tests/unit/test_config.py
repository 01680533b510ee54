"""RunConfig validation: clear, one-line, field-naming errors; frozen; version hash."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from collab.config import ConfigError, load_config, parse_config
from tests.conftest import CONFIGS


def _errors(data: object) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    return e.value.problems


def test_shipped_configs_are_valid() -> None:
    for path in sorted(CONFIGS.glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.run_id


def test_each_problem_names_its_field() -> None:
    problems = _errors(
        {
            "method": {"name": "masha1", "gamma": -1, "device_compressor": {"name": "randk", "ratio": 1.5}},
            "num_devices": 0,
            "surprise": 1,
        }
    )
    assert any(p.startswith("method.gamma:") for p in problems)
    assert any(p.startswith("method.device_compressor.ratio:") for p in problems)
    assert any(p.startswith("num_devices:") for p in problems)
    assert any(p.startswith("surprise:") and "not permitted" in p for p in problems)
    assert all("\n" not in p for p in problems)


@pytest.mark.parametrize(
    "method,compressor,needle",
    [
        ("masha2", "randk", "contractive"),
        ("masha1", "topk", "unbiased"),
        ("extragradient", "topk", "uncompressed"),
    ],
)
def test_method_and_compressor_must_fit(method: str, compressor: str, needle: str) -> None:
    problems = _errors({"method": {"name": method, "gamma": 0.1, "device_compressor": {"name": compressor}}})
    assert len(problems) == 1 and problems[0].startswith("method:") and needle in problems[0]


def test_missing_method_and_bad_types() -> None:
    assert _errors({}) == ["method: Field required"]
    assert any(p.startswith("method.tau:") for p in _errors({"method": {"gamma": 1, "tau": 1.0}}))
    assert any(p.startswith("method.anchor:") for p in _errors({"method": {"gamma": 1, "anchor": 1.0}}))
    eg = _errors({"method": {"name": "extragradient", "gamma": 1, "anchor": 0.0}})
    assert len(eg) == 1 and eg[0].startswith("method:") and "no reference point" in eg[0]
    assert _errors([1, 2]) == ["(top level): a config must be a mapping of fields"]


def test_config_is_frozen_and_versioned() -> None:
    cfg = parse_config({"method": {"gamma": 0.1}})
    with pytest.raises(ValidationError):
        cfg.seed = 5  # type: ignore[misc]
    same = parse_config({"method": {"gamma": 0.1}, "seed": 0})
    other = parse_config({"method": {"gamma": 0.2}})
    assert cfg.version() == same.version() != other.version()


def test_load_config_file_errors(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("method: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad_yaml)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_default_tau_balances_exchanges() -> None:
    cfg = parse_config({"method": {"gamma": 0.1, "device_compressor": {"name": "randk", "ratio": 0.1}}})
    assert cfg.method.effective_tau(100) == pytest.approx(0.9)
