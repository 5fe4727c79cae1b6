"""The config loader: presets, dotted overrides, type coercion, clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest
import yaml

from pointforge.config.coercion import from_dict, to_dict
from pointforge.config.loader import dump_yaml, load, load_yaml, parse_overrides
from pointforge.errors import ConfigError
from pointforge.tasks.configs import load_train_config, train_config_from_dict
from tests.helpers import CONFIGS

TINY = CONFIGS / "toy" / "tiny.yaml"


@dataclass
class Inner:
    size: int = 3
    ratio: float = 0.5
    mode: Literal["fast", "slow"] = "fast"
    betas: tuple[float, float] = (0.9, 0.999)
    maybe: int | None = None
    flag: bool = False
    names: list[str] = field(default_factory=list)


@dataclass
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)


def test_overrides_coerce_to_field_types():
    cfg = load(
        Outer,
        overrides=[
            "inner.size=7",
            "inner.ratio=1e-4",
            "inner.betas=0.5,0.6",
            "inner.maybe=null",
            "inner.flag=yes",
            "inner.names=[a,b]",
            "name=run1",
        ],
    )
    assert cfg.inner.size == 7 and isinstance(cfg.inner.size, int)
    assert cfg.inner.ratio == pytest.approx(1e-4) and isinstance(cfg.inner.ratio, float)
    assert cfg.inner.betas == (0.5, 0.6)
    assert cfg.inner.maybe is None
    assert cfg.inner.flag is True
    assert cfg.inner.names == ["a", "b"]
    assert cfg.name == "run1"


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"inner": {"size": 4, "mode": "slow"}}))
    cfg = load(Outer, path, ["inner.size=5"])
    assert (cfg.inner.size, cfg.inner.mode) == (5, "slow")


def test_unknown_key_names_key_choices_and_suggestion():
    with pytest.raises(ConfigError) as info:
        load(Outer, overrides=["inner.sise=3"])
    msg = str(info.value)
    assert "inner.sise" in msg and "did you mean 'inner.size'" in msg and "ratio" in msg


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError, match=r"inner.size' got 'abc', expected int"):
        load(Outer, overrides=["inner.size=abc"])
    with pytest.raises(ConfigError, match=r"inner.size' got 2.5, expected int"):
        load(Outer, overrides=["inner.size=2.5"])
    with pytest.raises(ConfigError, match="valid choices: fast, slow"):
        load(Outer, overrides=["inner.mode=medium"])
    with pytest.raises(ConfigError, match="is a section"):
        load(Outer, overrides=["inner=3"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["optim.lr"])


def test_round_trip_through_dict():
    cfg = load(Outer, overrides=["inner.betas=[0.1,0.2]"])
    again = from_dict(Outer, yaml.safe_load(dump_yaml(cfg)))
    assert again == cfg


def test_train_config_from_preset_and_task_section():
    cfg = load_train_config("toy", TINY, ["optim.lr=1e-4", "data.global_batch=16", "task.hidden=8", "log.progress=off"])
    assert cfg.optim.lr == pytest.approx(1e-4)
    assert cfg.data.global_batch == 16
    assert cfg.task.hidden == 8 and type(cfg.task).__name__ == "ToyConfig"
    assert cfg.log.progress == "off"
    assert cfg.run.task == "toy" and cfg.run.dir == "runs/toy/tiny"
    rebuilt = train_config_from_dict(to_dict(cfg))
    assert rebuilt == cfg


def test_train_config_errors_are_specific():
    with pytest.raises(ConfigError, match="unknown config key 'task.hiddn'; did you mean 'task.hidden'"):
        load_train_config("toy", TINY, ["task.hiddn=3"])
    with pytest.raises(ConfigError, match="optim.lr_scaling=linear' needs 'optim.base_batch'"):
        load_train_config("toy", TINY, ["optim.lr_scaling=linear"])
    with pytest.raises(ConfigError, match="unknown task 'toyy'; did you mean 'toy'"):
        load_train_config("toyy", TINY)
    with pytest.raises(ConfigError, match="does not exist"):
        load_train_config("toy", TINY.with_name("missing.yaml"))


def test_bad_yaml_reports_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  epochs: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(path)


def test_a_typo_inside_an_optional_section_names_the_key():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'task.synthetic.skulss'; did you mean 'task.synthetic.skulls'\?"
    ):
        load_train_config("pcdiff", None, ["task.synthetic.skulss=3"])


# Knobs of experiments measured negative and removed (docs/experiments/): a config that
# still names one gets the one-line unknown-key error, as for any other key.
REMOVED_KNOBS = [
    ("pcdiff", {"prior": {"condition": 256}}, "task.prior.condition"),
    ("pcdiff", {"prior": {"correct": 0.5}}, "task.prior.correct"),
    ("voxelizer", {"shrink_p": 0.5}, "task.shrink_p"),
    ("voxelizer", {"shrink_min": 0.7}, "task.shrink_min"),
    ("upsampler", {"model": {"gate_init": 0.1}}, "task.model.gate_init"),
    ("upsampler", {"surface_loss": "absolute"}, "task.surface_loss"),
]


@pytest.mark.parametrize("task, section, key", REMOVED_KNOBS)
def test_a_removed_knob_is_an_unknown_key(tmp_path, task, section, key):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"task": section}))
    with pytest.raises(ConfigError) as info:
        load_train_config(task, path)
    message = str(info.value)
    assert message.startswith(f"unknown config key '{key}'; ") and "\n" not in message
    with pytest.raises(ConfigError, match=f"^unknown config key '{key}'; "):
        load_train_config(task, None, [f"{key}=1"])
