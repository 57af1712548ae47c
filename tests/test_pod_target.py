"""The pod job's target path: an HF checkpoint converted once into a target workdir, then restored
by the drafter trainer straight into the FSDP shardings (8 fake CPU devices)."""
import jax
import numpy as np
import pytest
from flax import nnx

from experiments.hf_to_target import convert
from specjax.models import get_preset, init_model
from specjax.models.hf_io import save_hf_checkpoint


def test_hf_target_is_restored_sharded_into_the_drafter_trainer(tmp_path):
    from experiments.configs.train_drafter import get_config
    from specjax.training.trainer import Trainer

    model = init_model(get_preset("tiny"), seed=7)
    save_hf_checkpoint(model, None, str(tmp_path / "hf"))
    workdir = convert(str(tmp_path / "hf"), "tiny", str(tmp_path / "target"), dtype="float32")

    config = get_config("mtp_e2e_tv,tiny")
    config.unlock()
    config.model.overrides = {}
    config.task.target_workdir = workdir
    config.mesh.fsdp = 8
    config.data.batch_size = 8
    config.lock()
    trainer = Trainer(config)
    frozen = trainer.frozen["target"]
    want = nnx.to_pure_dict(nnx.state(model))
    got_leaves, want_leaves = jax.tree.leaves(frozen), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for got, ref in zip(got_leaves, want_leaves):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    # restored into the trainer's shardings: the embedding is split over fsdp on its embed axis
    assert frozen["embed"].sharding == trainer.frozen_shardings["target"]["embed"]
    assert frozen["embed"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")


def test_convert_refuses_a_checkpoint_of_another_architecture(tmp_path):
    save_hf_checkpoint(init_model(get_preset("tiny", num_layers=3)), None, str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="num_layers"):
        convert(str(tmp_path / "hf"), "tiny", str(tmp_path / "target"))


def test_pod_config_keeps_the_tokens_per_step_at_any_sequence():
    """``tpu_pod.py:<target>,<drafter>,<slice>[,<seq_len>]``: every step trains on 256 x 4096
    tokens, in microbatches of one row per chip, whatever the sequence; a sequence that does not
    divide the step is refused."""
    from experiments.configs.tpu_pod import TOKENS_PER_STEP, get_config
    for arg, seq, chips in [("qwen3-8b,mtp,v5e-8,4096", 4096, 8),
                            ("qwen3-8b,mtp,v5e-8,1024", 1024, 8),
                            ("qwen3-0.6b,dspark,v5e-256,512", 512, 256),
                            ("qwen3-4b,dspark,v5p-64", 4096, 32)]:
        c = get_config(arg)
        assert c.data.seq_len == seq, arg
        assert c.data.batch_size * seq == TOKENS_PER_STEP, arg
        assert c.data.batch_size == chips * c.train.grad_accum_steps, arg
    for bad in ("3000", "0", "x"):
        with pytest.raises(ValueError, match="seq_len"):
            get_config(f"qwen3-8b,mtp,v5e-8,{bad}")
    # the tries of `tpu_plan --table` are such configs: 4096 halved down to 512
    from experiments.configs.tpu_pod import table_sequences
    assert table_sequences() == [4096, 2048, 1024, 512]
    for seq in table_sequences():
        assert get_config(f"qwen3-8b,dspark,v5e-8,{seq}").data.batch_size * seq == TOKENS_PER_STEP


def test_pod_config_sequences_follow_the_compiled_table():
    """``tpu_pod.py``'s default sequence for each slice, target and drafter of the docs/TPU.md
    table is the longest one at which that row fits (``experiments/results/tpu/table.json``, from
    ``tpu_plan``), and its mesh is the row's: the committed table and the config cannot drift
    apart. Other slices of a chip
    take the shortest sequence listed for it."""
    import json
    import os

    from experiments.configs.tpu_pod import SEQ_LEN, TABLE_SLICES, default_seq, get_config
    from specjax.aot.chips import topology_name
    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "results", "tpu",
                        "table.json")
    slices = {topology_name(s): s for s in TABLE_SLICES}
    tried = {}
    for r in json.load(open(path)):
        key = (slices[r["topology"]], r["shapes"]["model"], r["shapes"]["drafter"])
        tried.setdefault(key, []).append((r["shapes"]["seq"], r["fits"]))
        # and each row was compiled on the mesh the config gives (data x fsdp)
        c = get_config(f"{key[1]},{key[2]},{key[0]},{r['shapes']['seq']}")
        chips = r["num_devices"]
        assert (c.mesh.data, chips // c.mesh.data, c.mesh.fsdp) == \
            (r["mesh"]["data"], r["mesh"]["fsdp"], -1), key
    assert len(tried) == 24  # 4 slices x 3 targets x 2 drafters
    for (slice_name, target, drafter), rows in tried.items():
        fit = max(seq for seq, fits in rows if fits)
        assert all(not fits for seq, fits in rows if seq > fit)
        assert get_config(f"{target},{drafter},{slice_name}").data.seq_len == fit, \
            (slice_name, target, drafter)
    assert default_seq("v5e:4x4", "qwen3-8b", "mtp") == 2048  # another v5e slice
    assert default_seq("v6e:8x8", "qwen3-8b", "mtp") == SEQ_LEN


def test_fsdp_width_keeps_whole_bf16_tiles_of_the_hidden_dimension_per_chip():
    """FSDP over the most chips that leave each a multiple of 16 hidden rows; data parallel over
    the rest (docs/TPU.md, "FSDP width")."""
    from experiments.configs.tpu_pod import fsdp_width, get_config
    assert fsdp_width(256, 2560) == 32  # Qwen3-4B: 80 rows per chip (64 chips: 40, not whole)
    assert fsdp_width(256, 4096) == 256  # Qwen3-8B: 16 rows per chip
    assert fsdp_width(256, 1024) == 64  # Qwen3-0.6B: 16 rows per chip
    assert fsdp_width(8, 2560) == 8 and fsdp_width(32, 2560) == 32
    assert fsdp_width(12, 96) == 6  # 16 rows each; not only powers of two
    assert fsdp_width(8, 40) == 8  # no width leaves whole tiles: every chip, as before
    c = get_config("qwen3-4b,mtp,v5e-256")
    assert (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) == (8, -1, 1)
    assert c.data.batch_size == 256 * c.train.grad_accum_steps  # still one row per chip
