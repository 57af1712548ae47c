"""HF interop (specjax.models.hf_io): config mapping, safetensors import/export, parity with
transformers on tiny random Qwen3 / Llama models built and saved locally (nothing is downloaded).

Tests that need torch + transformers (the ``interop`` extra) skip with a reason without them; the
config, export/import and error tests run on safetensors alone.
"""
import json
import os
import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from flax import nnx
from safetensors.numpy import load_file, save_file

from specjax.models import PRESETS, ModelConfig, RopeScaling, get_preset, init_cache, init_model
from specjax.models import hf_io
from specjax.models.transformer import apply_jit, cached_forward
from specjax.models.generate import generate

# One worker builds the torch models once (module-scoped fixtures) instead of one per xdist worker.
pytestmark = pytest.mark.xdist_group("hf_interop")

RTOL = 1e-4  # max |ours - hf| / max |hf|, float32 everywhere

# Tiny shapes covering GQA ratios 1 and 4, tied / untied embeddings, head_dim != hidden / heads,
# Llama-3 RoPE scaling (original_max_position_embeddings=256 puts the 4 frequencies of head_dim 8
# in all three bands: kept, interpolated, divided) and a sharded checkpoint.
CASES = {
    "qwen3-mha-tied-hd16": dict(arch="qwen3", hidden_size=32, num_attention_heads=4,
                                num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
    "qwen3-gqa4-sharded": dict(arch="qwen3", hidden_size=64, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                               shard="24KB"),
    "llama-gqa4-llama3rope": dict(arch="llama", hidden_size=32, num_attention_heads=4,
                                  num_key_value_heads=1, tie_word_embeddings=False,
                                  rope_theta=5e5, rope_scaling=dict(
                                      rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=256)),
    "llama-mha-tied-hd16": dict(arch="llama", hidden_size=32, num_attention_heads=4,
                                num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
}


def rel_err(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("torch", reason="needs the 'interop' extra (torch)")
    return pytest.importorskip("transformers", reason="needs the 'interop' extra (transformers)")


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, hf, tmp_path_factory):
    """``(name, hf_model, checkpoint_dir, specjax_model)`` for one tiny random model."""
    import torch

    name = request.param
    spec = dict(CASES[name])
    arch, shard = spec.pop("arch"), spec.pop("shard", None)
    cfg_cls, model_cls = ((hf.Qwen3Config, hf.Qwen3ForCausalLM) if arch == "qwen3"
                          else (hf.LlamaConfig, hf.LlamaForCausalLM))
    # initializer_range 0.2 (not 0.02) spreads the logits over a few nats, so greedy argmaxes are
    # far from ties; no bos/eos/pad so that HF generate never stops early.
    config = cfg_cls(vocab_size=96, intermediate_size=64, num_hidden_layers=2, rms_norm_eps=1e-6,
                     initializer_range=0.2, bos_token_id=None, eos_token_id=None,
                     pad_token_id=None, **spec)
    torch.manual_seed(sorted(CASES).index(name))
    model = model_cls(config).eval().float()
    path = tmp_path_factory.mktemp(name)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if shard:
        assert os.path.isfile(path / "model.safetensors.index.json")
        assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    return name, model, path, hf_io.load_model(path)


def sj_logits(model, tokens):
    """specjax no-cache logits, jitted (one compile per model and shape; eager op-by-op dispatch
    would compile every primitive separately, which is slower for these tests)."""
    graphdef, state = nnx.split(model)
    return np.asarray(apply_jit(graphdef, state, jnp.asarray(tokens)).logits)


def hf_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


# ---------------------------------------------------------------------------------------------
# Parity with transformers
# ---------------------------------------------------------------------------------------------
def test_config_matches(case):
    name, hf_model, _, model = case
    c = model.config
    hc = hf_model.config
    assert c.architecture == hc.model_type and c.qk_norm == (hc.model_type == "qwen3")
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (
        hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
    assert c.tie_embeddings == hc.tie_word_embeddings
    assert (model.lm_head is None) == c.tie_embeddings
    if "llama3rope" in name:
        assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 256) and c.rope_theta == 5e5


def test_prefill_logits_match(case):
    name, hf_model, _, model = case
    tokens = np.random.default_rng(0).integers(0, 96, (2, 24))
    err = rel_err(sj_logits(model, tokens), hf_logits(hf_model, tokens))
    print(f"{name}: prefill rel err {err:.2e}")
    assert err <= RTOL


def test_cached_decode_logits_match(case):
    """Ragged prefill (prefixes 5 and 11) then token-by-token decode vs HF's full forward."""
    name, hf_model, _, model = case
    n, prefixes = 24, np.array([5, 11])
    tokens = np.random.default_rng(1).integers(0, 96, (2, n))
    ref = hf_logits(hf_model, tokens)
    ours = np.zeros_like(ref)
    graphdef, state = nnx.split(model)

    def step(feed, cache, num_valid):
        return cached_forward(graphdef, state, jnp.asarray(feed, jnp.int32), cache,
                              jnp.asarray(num_valid, jnp.int32))

    prefill = np.where(np.arange(11)[None] < prefixes[:, None], tokens[:, :11], 0)
    out = step(prefill, init_cache(model.config, 2, n + 16), prefixes)
    for b, p in enumerate(prefixes):
        ours[b, :p] = np.asarray(out.logits[b, :p])
    cache = out.cache
    for j in range(n - prefixes.min()):
        pos = prefixes + j  # row b decodes its position pos[b]; rows past n feed padding
        feed = np.where(pos < n, tokens[np.arange(2), np.minimum(pos, n - 1)], 0)[:, None]
        out = step(feed, cache, [1, 1])
        cache = out.cache
        for b in range(2):
            if pos[b] < n:
                ours[b, pos[b]] = np.asarray(out.logits[b, 0])
    err = rel_err(ours, ref)
    print(f"{name}: cached decode rel err {err:.2e}")
    assert err <= RTOL


def test_greedy_generation_matches_hf(case):
    import torch

    name, hf_model, _, model = case
    prompts = [[3, 14, 15], [9, 26, 53, 58, 1, 93, 23]]
    ours = generate(model, prompts, 32)
    for prompt, row in zip(prompts, ours):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                                    pad_token_id=0)
        assert row == out[0, len(prompt):].tolist(), name


def test_export_reload_in_transformers(case, tmp_path, hf):
    """specjax -> save_hf_checkpoint -> AutoModelForCausalLM: identical tensors and logits."""
    name, hf_model, _, model = case
    shard = 8192 if "sharded" in name else None
    hf_io.save_hf_checkpoint(model, None, tmp_path, max_shard_bytes=shard)
    assert os.path.isfile(tmp_path / ("model.safetensors.index.json" if shard
                                      else "model.safetensors"))
    reloaded = hf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(hf_model)
    original = hf_model.state_dict()
    for key, value in reloaded.state_dict().items():
        assert np.array_equal(value.numpy(), original[key].numpy()), key
    tokens = np.random.default_rng(2).integers(0, 96, (2, 24))
    err = rel_err(hf_logits(reloaded, tokens), sj_logits(model, tokens))
    print(f"{name}: exported -> transformers rel err {err:.2e}")
    assert err <= RTOL
    # And back: the re-export loads into specjax unchanged.
    again = hf_io.load_model(tmp_path)
    assert again.config == model.config


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_native_model_exports_to_transformers(arch, tmp_path, hf):
    """A specjax-initialised model (not from HF) exports to a checkpoint transformers runs."""
    if arch == "qwen3":
        config = get_preset("tiny", tie_embeddings=False)
    else:
        config = get_preset("tiny", architecture="llama", qk_norm=False, rope_theta=5e5,
                            rope_scaling=RopeScaling(4.0, 1.0, 4.0, 128))
    model = init_model(config, seed=3)
    hf_io.save_hf_checkpoint(model, config, tmp_path)
    reloaded = hf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, (2, 24))
    err = rel_err(hf_logits(reloaded, tokens), sj_logits(model, tokens))
    print(f"native {arch}: exported -> transformers rel err {err:.2e}")
    assert err <= RTOL


# ---------------------------------------------------------------------------------------------
# Config mapping (no torch)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_round_trip(name):
    c = PRESETS[name]
    # HF has one dtype (the parameters'); it comes back as both compute and parameter dtype.
    assert hf_io.config_from_hf(hf_io.config_to_hf(c)) == c.replace(dtype=c.param_dtype)


def test_config_layouts_old_new_nested():
    base = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64,
                hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True)
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=512)
    expected = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                           num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=5e5,
                           rope_scaling=RopeScaling(**scaling), rms_norm_eps=1e-5, qk_norm=False,
                           tie_embeddings=True, max_position_embeddings=2048, dtype="bfloat16",
                           param_dtype="bfloat16", architecture="llama")
    old = dict(base, rope_theta=5e5, rope_scaling=dict(scaling, type="llama3"),
               torch_dtype="bfloat16")
    new = dict(base, rope_parameters=dict(scaling, rope_type="llama3", rope_theta=5e5),
               dtype="bfloat16")
    nested = dict(base, dtype="bfloat16", rope_parameters={
        "full_attention": dict(scaling, rope_type="llama3", rope_theta=5e5)})
    for cfg in (old, new, nested):
        assert hf_io.config_from_hf(cfg) == expected
    assert hf_io.config_from_hf(new, dtype="float32").param_dtype == "float32"
    # Qwen3: explicit head_dim, qk-norm, default rope.
    q = hf_io.config_from_hf(dict(base, model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                                  head_dim=16, rope_theta=1e6))
    assert (q.head_dim, q.qk_norm, q.rope_scaling, q.rope_theta) == (16, True, None, 1e6)


@pytest.mark.parametrize("change, match", [
    (dict(model_type="mistral"), "unsupported model_type 'mistral'.*Qwen3ForCausalLM.*"
                                 "LlamaForCausalLM"),
    (dict(architectures=["Qwen3ForSequenceClassification"]), "unsupported architectures"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(use_sliding_window=True), "sliding"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), "rope_type 'yarn'"),
])
def test_config_errors(change, match):
    cfg = dict(hf_io.config_to_hf(PRESETS["tiny"]), **change)
    with pytest.raises(ValueError, match=match):
        hf_io.config_from_hf(cfg)


# ---------------------------------------------------------------------------------------------
# Checkpoint files and errors (no torch)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return init_model(get_preset("tiny"), seed=0)


@pytest.fixture
def ckpt(tiny, tmp_path):
    hf_io.save_hf_checkpoint(tiny, tiny.config, tmp_path)
    return tmp_path


def _params(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def test_save_load_round_trip_sharded(tiny, tmp_path):
    files = hf_io.save_hf_checkpoint(tiny, None, tmp_path, max_shard_bytes=20_000)
    assert len(files) > 4 and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {s.hf_name for s in hf_io.hf_tensor_specs(tiny.config)}
    config, state = hf_io.load_hf_checkpoint(tmp_path)
    assert config == tiny.config
    loaded = hf_io.load_model(tmp_path)
    ref = _params(tiny)
    assert all(np.array_equal(v, ref[p]) for p, v in _params(loaded).items())
    assert loaded.embed.logical_axes == ("vocab", "embed")
    # The loaded State and its pure-dict form export the same tensors as the model.
    hf_io.save_hf_checkpoint(tiny, None, tmp_path / "ref")
    ref_tensors = load_file(tmp_path / "ref" / "model.safetensors")
    for i, obj in enumerate([state, nnx.to_pure_dict(state)]):
        hf_io.save_hf_checkpoint(obj, config, tmp_path / f"copy{i}")
        copy = load_file(tmp_path / f"copy{i}" / "model.safetensors")
        assert copy.keys() == ref_tensors.keys()
        assert all(np.array_equal(v, ref_tensors[k]) for k, v in copy.items())
    # Re-saving unsharded into the same directory removes the stale shards and index.
    hf_io.save_hf_checkpoint(tiny, None, tmp_path)
    assert sorted(f for f in os.listdir(tmp_path) if os.path.isfile(tmp_path / f)) == [
        "config.json", "model.safetensors"]


def test_bf16_checkpoint(tiny, tmp_path):
    config = tiny.config.replace(param_dtype="bfloat16")
    hf_io.save_hf_checkpoint(tiny, config, tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as fh:
        assert fh.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    bf16 = hf_io.load_model(tmp_path)
    assert bf16.config.param_dtype == bf16.config.dtype == "bfloat16"
    assert bf16.embed.get_value().dtype == jnp.bfloat16
    f32 = hf_io.load_model(tmp_path, dtype="float32")
    assert f32.embed.get_value().dtype == jnp.float32
    expected = np.asarray(tiny.embed.get_value()).astype(ml_dtypes.bfloat16)
    assert np.array_equal(np.asarray(bf16.embed.get_value()), expected)
    assert np.array_equal(np.asarray(f32.embed.get_value()), expected.astype(np.float32))


def test_missing_config(ckpt):
    os.remove(ckpt / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_io.load_hf_checkpoint(ckpt)


def test_unsupported_architecture_file(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type 'gpt2'.*supported: Qwen3ForCausalLM"):
        hf_io.load_model(ckpt)


def _rewrite(ckpt, edit):
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensors_listed(ckpt):
    names = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    _rewrite(ckpt, lambda t: [t.pop(n) for n in names])
    with pytest.raises(ValueError, match=r"missing 2 tensor\(s\).*up_proj.*model\.norm\.weight"):
        hf_io.load_hf_checkpoint(ckpt)


def test_shape_mismatch_named(ckpt):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(ckpt, lambda t: t.update({name: np.zeros((16, 64), np.float32)}))
    with pytest.raises(ValueError, match=rf"{name}.*expected shape \(32, 64\).*got \(16, 64\)"):
        hf_io.load_hf_checkpoint(ckpt)


def test_unexpected_tensors_error_or_warn(ckpt, tiny):
    bias = "model.layers.0.self_attn.q_proj.bias"
    _rewrite(ckpt, lambda t: t.update({bias: np.zeros(64, np.float32),
                                       "model.layers.0.self_attn.rotary_emb.inv_freq":
                                           np.zeros(8, np.float32),
                                       # tied model: a duplicated lm_head is ignored, like HF
                                       "lm_head.weight": t["model.embed_tokens.weight"]}))
    with pytest.raises(ValueError, match=rf"1 tensor\(s\).*\['{bias}'\].*strict=False"):
        hf_io.load_hf_checkpoint(ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = hf_io.load_model(ckpt, strict=False)
    assert any(bias in str(w.message) for w in caught)
    assert np.array_equal(model.embed.get_value(), tiny.embed.get_value())


def test_untied_needs_lm_head(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=False)))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\).*lm_head\.weight"):
        hf_io.load_hf_checkpoint(ckpt)


def test_index_names_absent_shard(tiny, tmp_path):
    hf_io.save_hf_checkpoint(tiny, None, tmp_path, max_shard_bytes=20_000)
    os.remove(tmp_path / "model-00002-of-{:05d}.safetensors".format(
        len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")])))
    with pytest.raises(FileNotFoundError, match="model-00002"):
        hf_io.load_hf_checkpoint(tmp_path)


def test_save_rejects_wrong_shapes(tiny, tmp_path):
    with pytest.raises(ValueError, match="expected shape"):
        hf_io.save_hf_checkpoint(tiny, tiny.config.replace(intermediate_size=96), tmp_path)


def test_load_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = hf_io.load_tokenizer_json(tmp_path)
    assert loaded.encode("hello world") == [1, 2] and loaded.eos_id == 0
    assert loaded.decode([1, 2]) == "hello world"
