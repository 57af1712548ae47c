"""Target models: Qwen3 / Llama-family transformer, KV cache, HF safetensors interop."""
from specjax.models.config import PRESETS, ModelConfig, RopeScaling, get_preset
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.transformer import (ForwardOutput, Transformer, apply, apply_flat,
                                        apply_flat_jit, apply_jit, cached_forward, init_model)

__all__ = ["PRESETS", "ModelConfig", "RopeScaling", "get_preset", "KVCache", "init_cache",
           "ForwardOutput", "Transformer", "apply", "apply_flat", "apply_flat_jit", "apply_jit",
           "cached_forward", "init_model"]
