"""Hugging Face ``config.json`` <-> :class:`~specjax.models.config.ModelConfig`.

Qwen3 (``model_type="qwen3"``, QK-norm) and Llama (``"llama"``) configs, in both the transformers-5
layout (``rope_parameters``, ``dtype``) and the older one (``rope_theta``, ``rope_scaling``,
``torch_dtype``). What specjax does not model (biases, sliding windows, quantisation, partial RoPE,
RoPE scaling other than Llama-3's) raises a ``ValueError`` that says what is supported. The tensors
themselves are read and written by :mod:`specjax.models.hf_io`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from specjax.models.config import ModelConfig, RopeScaling

__all__ = ["SUPPORTED_ARCHITECTURES", "PARAM_DTYPES", "config_from_hf", "config_to_hf"]

# model_type -> the HF class name written to / accepted from `architectures`.
SUPPORTED_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
# Parameter dtypes a checkpoint may declare (others load as float32 unless `dtype=` is given).
PARAM_DTYPES = ("float32", "bfloat16", "float16")


def _supported() -> str:
    return ", ".join(f"{cls} (model_type={mt!r})" for mt, cls in SUPPORTED_ARCHITECTURES.items())


def _rope_dict(hf: dict) -> dict:
    """The RoPE parameters of either config layout, as one flat dict (``rope_theta`` included).

    transformers >= 5 writes ``rope_parameters`` (optionally nested per layer type); older versions
    write top-level ``rope_theta`` plus an optional ``rope_scaling`` dict (``type`` or
    ``rope_type``).
    """
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be a dict, got {params!r}")
    nested = [v for v in params.values() if isinstance(v, dict)]
    if nested:  # {"full_attention": {...}, "sliding_attention": {...}}: one RoPE for all layers.
        if any(v != nested[0] for v in nested[1:]):
            raise ValueError(f"per-layer-type RoPE parameters differ ({params}); specjax uses one "
                             f"RoPE for every layer")
        params = nested[0]
    params = dict(params)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if params.get("rope_theta") is None:
        params["rope_theta"] = hf.get("rope_theta", 10000.0)
    return params


def config_from_hf(hf_config: Union[dict, Any], *, dtype: Optional[str] = None) -> ModelConfig:
    """Converts an HF ``config.json`` dict (or a transformers config object) to a ModelConfig.

    Args:
      hf_config: the parsed ``config.json`` (old or transformers-5 layout).
      dtype: compute and parameter dtype ("float32" / "bfloat16" / "float16"); default: the
        checkpoint's ``dtype`` / ``torch_dtype`` (float32 if absent or not one of those).
    Raises:
      ValueError: unsupported architecture or feature (biases, sliding window, RoPE variant, ...).
    """
    hf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r} (architectures="
                         f"{hf.get('architectures')}); supported: {_supported()}")
    archs = hf.get("architectures") or [SUPPORTED_ARCHITECTURES[model_type]]
    if list(archs) != [SUPPORTED_ARCHITECTURES[model_type]]:
        raise ValueError(f"unsupported architectures {archs} for model_type {model_type!r}; "
                         f"supported: {_supported()}")
    if hf.get("quantization_config"):
        raise ValueError("quantized checkpoints are not supported (quantization_config is set)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{flag}=True is not supported: specjax projections have no bias")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        raise ValueError("sliding-window attention is not supported (use_sliding_window / "
                         "layer_types); specjax attends to the full context")

    rope = _rope_dict(hf)
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (RoPE on all dims)")
    rope_type = rope.get("rope_type") or "default"
    if rope_type == "default":
        scaling = None
    elif rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    else:
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")

    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    absent = [k for k in required if hf.get(k) is None]
    if absent:
        raise ValueError(f"HF config lacks required keys {absent}")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim")
    if head_dim is None:  # Mirror transformers' defaults: Qwen3Config 128, LlamaConfig D / H.
        head_dim = 128 if model_type == "qwen3" else hidden // heads
    if dtype is None:  # "bfloat16", or "torch.bfloat16" from a transformers config object.
        declared = str(hf.get("dtype") or hf.get("torch_dtype") or "").removeprefix("torch.")
        dtype = declared if declared in PARAM_DTYPES else "float32"
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings",
                                           32768 if model_type == "qwen3" else 2048)),
        dtype=dtype,
        param_dtype=dtype,
        architecture=model_type,
    )


def config_to_hf(config: ModelConfig, **extra) -> dict:
    """HF ``config.json`` contents for ``config`` (``extra`` keys, e.g. ``eos_token_id``, win).

    Writes the transformers-5 layout (``rope_parameters``, ``dtype``) plus the legacy keys
    (``rope_theta``, ``rope_scaling``, ``torch_dtype``) so that transformers 4.x reads it too.
    """
    c = config
    if c.qk_norm != (c.architecture == "qwen3"):
        raise ValueError(f"architecture {c.architecture!r} with qk_norm={c.qk_norm} has no HF "
                         f"equivalent (Qwen3 has QK-norm, Llama does not)")
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta,
                **dataclasses.asdict(c.rope_scaling)}
    out = {
        "architectures": [SUPPORTED_ARCHITECTURES[c.architecture]],
        "model_type": c.architecture,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "rope_parameters": rope,
        "rope_theta": c.rope_theta,
        "dtype": c.param_dtype,
        "torch_dtype": c.param_dtype,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if c.rope_scaling is not None:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if c.architecture == "llama":
        out.update(mlp_bias=False, pretraining_tp=1)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.num_layers,
                   layer_types=["full_attention"] * c.num_layers)
    out.update(extra)
    return out
