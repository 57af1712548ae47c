"""Bad training configs fail fast (before any device work) with a message naming the field."""
import os

import ml_collections
import pytest
from _train_common import train_cli

from specjax.training import ConfigError, default_config, validate_config


@pytest.mark.parametrize("user, pattern", [
    ({"trian": {"num_steps": 3}}, r"config\.trian: unknown field \(did you mean 'train'\?\)"),
    ({"train": {"num_stpes": 3}},
     r"config\.train\.num_stpes: unknown field \(did you mean 'train\.num_steps'\?\)"),
    ({"train": {"num_steps": "10"}}, r"config\.train\.num_steps: expected int, got str"),
    ({"train": {"num_steps": 2.5}}, r"config\.train\.num_steps: expected int, got float"),
    ({"checkpoint": {"async_save": 1}}, r"config\.checkpoint\.async_save: expected bool"),
    ({"optimizer": {"learning_rate": "fast"}}, r"config\.optimizer\.learning_rate: expected float"),
    ({"train": 5}, r"config\.train: expected a group of fields"),
    ({"seed": {"a": 1}}, r"config\.seed: expected a single int value, got a group"),
    ({"train": {"num_steps": 0}}, r"config\.train\.num_steps: must be > 0"),
    ({"data": {"kind": "parquet"}}, r"config\.data\.kind: must be one of"),
    ({"model": {"preset": "gpt5"}}, r"config\.model\.preset: unknown preset 'gpt5'"),
    ({"model": {"overrides": {"hiden_size": 8}}},
     r"config\.model\.overrides\.hiden_size: not a ModelConfig field \(did you mean 'hidden_size'"),
    ({"model": {"overrides": {"num_layers": "2"}}},
     r"config\.model\.overrides\.num_layers: expected int"),
    ({"model": {"overrides": {"num_heads": 3}}}, r"config\.model\.overrides: .*num_heads"),
    ({"task": {"name": "mtp"}}, r"config\.task\.name: unknown task 'mtp'"),
    ({"task": {"z_loss": -1.0}}, r"config\.task\.z_loss: must be >= 0"),
    ({"data": {"batch_size": 6}, "train": {"grad_accum_steps": 4}},
     r"config\.data\.batch_size \(6\) must be a multiple of config\.train\.grad_accum_steps"),
    ({"optimizer": {"warmup_steps": 500}}, r"config\.optimizer\.warmup_steps \(500\) exceeds"),
    ({"sharding": {"on_indivisible": "ignore"}}, r"config\.sharding\.on_indivisible"),
])
def test_bad_field_is_named(user, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate_config(user)


def test_mesh_checked_against_device_count():
    with pytest.raises(ConfigError, match=r"config\.mesh: data=1 x fsdp=3 x tensor=1 = 3 "
                                          r"devices, but 8 are available \(does not divide"):
        validate_config({"mesh": {"fsdp": 3}}, num_devices=8)
    with pytest.raises(ConfigError, match=r"config\.mesh\.tensor must be a positive int or -1"):
        validate_config({"mesh": {"tensor": 0}}, num_devices=8)
    with pytest.raises(ConfigError, match=r"multiple of mesh data x fsdp = 8"):
        validate_config({"data": {"batch_size": 12}}, num_devices=8)
    assert validate_config({"mesh": {"data": 2, "fsdp": -1}}, num_devices=8).mesh.fsdp == -1


def test_defaults_are_locked_and_typed():
    c = default_config()
    with pytest.raises(AttributeError, match="num_stpes"):
        c.train.num_stpes = 3
    with pytest.raises(TypeError, match="num_steps"):
        c.train.num_steps = "3"
    c.model.overrides.hidden_size = 32  # the one free-form group, checked by validate_config
    full = validate_config(c)
    assert isinstance(full, ml_collections.ConfigDict) and full.is_locked
    assert full.optimizer.learning_rate == 3e-3 and full.model.overrides.hidden_size == 32
    # Partial user configs are completed from the schema; ints are accepted for floats.
    full = validate_config({"optimizer": {"learning_rate": 1}})
    assert full.optimizer.learning_rate == 1.0 and isinstance(full.optimizer.learning_rate, float)
    assert full.train.num_steps == default_config().train.num_steps


def test_command_line_rejects_misspelt_overrides_and_bad_mesh(tmp_path):
    # (mistyped values are rejected by the locked schema: test_defaults_are_locked_and_typed)
    cfg = "experiments/configs/pretrain_target.py:tiny"
    typo = train_cli("--config", cfg, "--config.train.num_stpes=3", "--workdir", str(tmp_path))
    assert typo.returncode != 0 and "num_stpes" in typo.stderr
    # model.overrides takes new keys from the command line; validate_config checks each by name
    field = train_cli("--config", cfg, "--config.model.overrides.hiden_size=32",
                      "--workdir", str(tmp_path))
    assert field.returncode == 2, field.stderr[-2000:]
    assert "did you mean 'hidden_size'" in field.stderr
    mesh = train_cli("--config", cfg, "--config.mesh.fsdp=3", "--config.data.kind=synthetic",
                     "--workdir", str(tmp_path))
    assert mesh.returncode == 2 and "config.mesh" in mesh.stderr, mesh.stderr[-2000:]
    assert not os.listdir(tmp_path)  # failed before writing anything
