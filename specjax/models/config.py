"""Configuration of the Qwen3 / Llama-family decoder-only target model.

One frozen dataclass describes every architectural choice; named presets give the shapes of the
public checkpoints (for TPU use) and tiny shapes for tests and the embedded default.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (HF ``rope_type="llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3 / Llama-family decoder.

    Attributes:
      vocab_size: V, rows of the embedding table and columns of the LM head.
      hidden_size: D, width of the residual stream.
      intermediate_size: F, width of the SwiGLU MLP.
      num_layers: L, number of transformer blocks.
      num_heads: H, query heads.
      num_kv_heads: KVH, key/value heads (grouped-query attention; H % KVH == 0).
      head_dim: Dh, per-head width; independent of D / H (Qwen3 uses 128 with D / H = 64 etc.).
      rope_theta: RoPE base.
      rope_scaling: optional Llama-3 frequency scaling.
      rms_norm_eps: epsilon of every RMSNorm.
      qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
      tie_embeddings: LM head shares the embedding matrix.
      max_position_embeddings: informational (HF config round trip); the cache length is chosen at
        cache creation.
      dtype: computation dtype of activations ("float32" or "bfloat16"). Logits and probabilities
        are always returned in float32.
      param_dtype: storage dtype of parameters.
      architecture: "qwen3" or "llama" (HF export picks the class from it).
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True
    tie_embeddings: bool = True
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    param_dtype: str = "float32"
    architecture: str = "qwen3"

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"ModelConfig.{name} must be one of {sorted(_DTYPES)}, "
                                 f"got {getattr(self, name)!r}")
        if self.architecture not in ("qwen3", "llama"):
            raise ValueError(f"ModelConfig.architecture must be 'qwen3' or 'llama', "
                             f"got {self.architecture!r}")

    @property
    def compute_dtype(self) -> Any:
        return _DTYPES[self.dtype]

    @property
    def weight_dtype(self) -> Any:
        return _DTYPES[self.param_dtype]

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **kwargs) -> "ModelConfig":
        return dataclasses.replace(self, **kwargs)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, h, kvh, dh = (self.hidden_size, self.intermediate_size, self.num_heads,
                            self.num_kv_heads, self.head_dim)
        attn = d * h * dh + 2 * d * kvh * dh + h * dh * d + (2 * dh if self.qk_norm else 0)
        block = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d
        return self.num_layers * block + emb * (1 if self.tie_embeddings else 2) + d


_LLAMA3_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    # Tests: 90,496 parameters (~90k; tests/test_model_presets.py counts them).
    "tiny": ModelConfig(),
    # Embedded default target trained on the CPU corpus (see experiments/configs).
    "small": ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=64),
    # ~50M parameters: the larger CPU benchmark point.
    "base50m": ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=12,
                           num_heads=8, num_kv_heads=4, head_dim=64),
    # Public checkpoint shapes (bf16 compute for TPU use).
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                              rope_theta=1e6, qk_norm=True, tie_embeddings=True,
                              max_position_embeddings=40960, dtype="bfloat16"),
    "qwen3-1.7b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                              num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                              rope_theta=1e6, qk_norm=True, tie_embeddings=True,
                              max_position_embeddings=40960, dtype="bfloat16"),
    "qwen3-4b": ModelConfig(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            rope_theta=1e6, qk_norm=True, tie_embeddings=True,
                            max_position_embeddings=40960, dtype="bfloat16"),
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            rope_theta=1e6, qk_norm=True, tie_embeddings=False,
                            max_position_embeddings=40960, dtype="bfloat16"),
    "llama-3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                                rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
                                rms_norm_eps=1e-5, qk_norm=False, tie_embeddings=True,
                                max_position_embeddings=131072, dtype="bfloat16",
                                architecture="llama"),
    "llama-3.2-3b": ModelConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
                                rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
                                rms_norm_eps=1e-5, qk_norm=False, tie_embeddings=True,
                                max_position_embeddings=131072, dtype="bfloat16",
                                architecture="llama"),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """Returns the named preset, optionally with fields replaced."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
