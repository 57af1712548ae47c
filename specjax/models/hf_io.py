"""Hugging Face interop: Qwen3 / Llama ``config.json`` + safetensors import and export.

Supported: ``Qwen3ForCausalLM`` (``model_type="qwen3"``) and ``LlamaForCausalLM`` (``"llama"``),
without biases, sliding windows or RoPE scaling other than Llama-3's. Anything else raises a
``ValueError`` that says what is supported.

Tensor layouts (HF ``nn.Linear`` weights are ``[out, in]``; ours are ``[in, ...out]``)::

  model.embed_tokens.weight                [V, D]       -> embed                [V, D]
  model.layers.{i}.self_attn.q_proj.weight [H*Dh, D]    -> layers[i].attn.q_proj [D, H, Dh]
  model.layers.{i}.self_attn.k_proj.weight [KVH*Dh, D]  -> layers[i].attn.k_proj [D, KVH, Dh]
  model.layers.{i}.self_attn.v_proj.weight [KVH*Dh, D]  -> layers[i].attn.v_proj [D, KVH, Dh]
  model.layers.{i}.self_attn.o_proj.weight [D, H*Dh]    -> layers[i].attn.o_proj [H, Dh, D]
  model.layers.{i}.self_attn.{q,k}_norm.weight [Dh]     -> layers[i].attn.{q,k}_norm.scale (Qwen3)
  model.layers.{i}.mlp.{gate,up}_proj.weight [F, D]     -> layers[i].mlp.{gate,up}_proj [D, F]
  model.layers.{i}.mlp.down_proj.weight    [D, F]       -> layers[i].mlp.down_proj [F, D]
  model.layers.{i}.input_layernorm.weight  [D]          -> layers[i].input_norm.scale
  model.layers.{i}.post_attention_layernorm.weight [D]  -> layers[i].post_attn_norm.scale
  model.norm.weight                        [D]          -> final_norm.scale
  lm_head.weight                           [V, D]       -> lm_head [D, V]   (absent when tied)

Every linear maps as ``ours = hf.T.reshape(our_shape)`` and back as
``hf = ours.reshape(hf_shape[::-1]).T``. Both HF and specjax apply RoPE in the "rotate_half"
convention, so no q/k row permutation is needed.

Loading policy: every check (config, missing tensors, shapes, dtypes) runs on the safetensors
headers *before* any tensor is read. Tensors are then read one at a time (numpy framework, never
pickle), converted to the parameter dtype and placed on the device, so host memory holds at most one
tensor's copies at a time. ``lm_head.weight`` is ignored when embeddings are tied (as transformers
does) and old ``rotary_emb.inv_freq`` buffers are ignored; any other unexpected tensor is an error
(``strict=True``, default: it usually means an architecture we do not model, e.g. biases or extra
MTP layers) or a warning (``strict=False``).
"""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from specjax.models.config import ModelConfig
from specjax.models.hf_config import (PARAM_DTYPES, SUPPORTED_ARCHITECTURES, config_from_hf,
                                      config_to_hf)
from specjax.models.transformer import Transformer

__all__ = ["SUPPORTED_ARCHITECTURES", "config_from_hf", "config_to_hf", "hf_tensor_specs",
           "load_hf_checkpoint", "load_model", "save_hf_checkpoint", "load_tokenizer_json"]

_NP_DTYPES = dict(zip(PARAM_DTYPES, (np.float32, ml_dtypes.bfloat16, np.float16)))
# safetensors dtype codes we accept as parameters (anything else is a quantised / odd checkpoint).
_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------------
# Tensor name / layout table
# ---------------------------------------------------------------------------------------------
class TensorSpec(NamedTuple):
    """One parameter: HF name and shape, specjax state path and shape, and whether it is linear."""

    hf_name: str
    path: tuple
    hf_shape: tuple
    shape: tuple
    linear: bool  # HF [out, in] <-> ours [in, ...out] via transpose + reshape

    def to_ours(self, w: np.ndarray) -> np.ndarray:
        return w.T.reshape(self.shape) if self.linear else w

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        return w.reshape(self.hf_shape[::-1]).T if self.linear else w


def hf_tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every parameter of ``config``'s model, in HF checkpoint order."""
    c = config
    d, f, v, dh = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    h, kvh = c.num_heads, c.num_kv_heads
    specs = [TensorSpec("model.embed_tokens.weight", ("embed",), (v, d), (v, d), False)]
    for i in range(c.num_layers):
        p, a, m = f"model.layers.{i}.", ("layers", i, "attn"), ("layers", i, "mlp")
        q_shapes = {"q": ((h * dh, d), (d, h, dh)), "k": ((kvh * dh, d), (d, kvh, dh)),
                    "v": ((kvh * dh, d), (d, kvh, dh)), "o": ((d, h * dh), (h, dh, d))}
        specs += [TensorSpec(p + f"self_attn.{n}_proj.weight", a + (f"{n}_proj",), hf_shape,
                             shape, True) for n, (hf_shape, shape) in q_shapes.items()]
        if c.qk_norm:
            specs += [TensorSpec(p + f"self_attn.{n}_norm.weight", a + (f"{n}_norm", "scale"),
                                 (dh,), (dh,), False) for n in ("q", "k")]
        specs += [
            TensorSpec(p + "mlp.gate_proj.weight", m + ("gate_proj",), (f, d), (d, f), True),
            TensorSpec(p + "mlp.up_proj.weight", m + ("up_proj",), (f, d), (d, f), True),
            TensorSpec(p + "mlp.down_proj.weight", m + ("down_proj",), (d, f), (f, d), True),
            TensorSpec(p + "input_layernorm.weight", ("layers", i, "input_norm", "scale"), (d,),
                       (d,), False),
            TensorSpec(p + "post_attention_layernorm.weight",
                       ("layers", i, "post_attn_norm", "scale"), (d,), (d,), False),
        ]
    specs.append(TensorSpec("model.norm.weight", ("final_norm", "scale"), (d,), (d,), False))
    if not c.tie_embeddings:
        specs.append(TensorSpec("lm_head.weight", ("lm_head",), (v, d), (d, v), True))
    return specs


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _tensor_files(path: str) -> dict[str, str]:
    """Maps every tensor name of the checkpoint in ``path`` to its safetensors file."""
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' dict")
        files = {name: os.path.join(path, fname) for name, fname in weight_map.items()}
        absent = sorted({f for f in files.values() if not os.path.isfile(f)})
        if absent:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {absent}")
        return files
    shards = [os.path.join(path, SINGLE_NAME)]
    if not os.path.isfile(shards[0]):
        # Sharded without an index: take every *.safetensors file (names must not repeat).
        shards = sorted(os.path.join(path, f) for f in os.listdir(path)
                        if f.endswith(".safetensors"))
        if not shards:
            raise FileNotFoundError(f"no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors in {path}")
    files: dict[str, str] = {}
    for shard in shards:
        with safe_open(shard, framework="numpy") as fh:
            for name in fh.keys():
                if name in files:
                    raise ValueError(f"tensor {name!r} appears in both {files[name]} and {shard}")
                files[name] = shard
    return files


def _headers(files: dict[str, str]) -> dict[str, tuple[tuple, str]]:
    """``name -> (shape, dtype code)`` from the safetensors headers (no tensor data is read)."""
    out = {}
    for shard in sorted(set(files.values())):
        with safe_open(shard, framework="numpy") as fh:
            present = set(fh.keys())
            for name in (n for n, f in files.items() if f == shard):
                if name not in present:
                    raise ValueError(f"index maps {name!r} to {shard}, which does not contain it")
                sl = fh.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def load_hf_checkpoint(path: Union[str, os.PathLike], *, dtype: Optional[str] = None,
                       strict: bool = True) -> tuple[ModelConfig, nnx.State]:
    """Loads a local HF Qwen3 / Llama checkpoint directory into specjax parameters.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or sharded
        ``model-*.safetensors`` (+ ``model.safetensors.index.json``).
      dtype: parameter and compute dtype; default: the checkpoint's declared dtype.
      strict: unexpected tensors raise (True) or only warn (False).
    Returns:
      ``(config, state)`` where ``state`` is the :class:`nnx.State` of ``nnx.split(Transformer)``
      (every leaf an ``nnx.Param`` with its logical axes). :func:`load_model` merges it.
    Raises:
      FileNotFoundError: no config.json / safetensors files.
      ValueError: unsupported architecture, missing / unexpected tensors (all listed), a shape
        mismatch (tensor, expected, got) or a non-float tensor.
    """
    path = os.fspath(path)
    cfg_file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{cfg_file} not found: a HF checkpoint directory needs "
                                f"{CONFIG_NAME} next to its safetensors files")
    config = config_from_hf(_read_json(cfg_file), dtype=dtype)
    files = _tensor_files(path)
    headers = _headers(files)
    specs = hf_tensor_specs(config)
    expected = {s.hf_name for s in specs}

    missing = [s.hf_name for s in specs if s.hf_name not in headers]
    if missing:
        raise ValueError(f"checkpoint {path} is missing {len(missing)} tensor(s) required by "
                         f"{SUPPORTED_ARCHITECTURES[config.architecture]}: {missing}")
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    unexpected = sorted(n for n in headers
                        if n not in expected and n not in ignorable and not _IGNORED.search(n))
    if unexpected:
        msg = (f"checkpoint {path} has {len(unexpected)} tensor(s) that "
               f"{SUPPORTED_ARCHITECTURES[config.architecture]} does not use: {unexpected}")
        if strict:
            raise ValueError(msg + " (pass strict=False to ignore them)")
        warnings.warn(msg + " (ignored)")
    for s in specs:
        shape, code = headers[s.hf_name]
        if shape != s.hf_shape:
            raise ValueError(f"tensor {s.hf_name!r}: expected shape {s.hf_shape} from config.json, "
                             f"got {shape}")
        if code not in _FLOAT_CODES:
            raise ValueError(f"tensor {s.hf_name!r} has dtype {code}; only float tensors "
                             f"({sorted(_FLOAT_CODES)}) are supported")

    # Abstract model: the state's structure and metadata without allocating random weights.
    _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    variables = dict(nnx.to_flat_state(abstract))
    np_dtype = _NP_DTYPES[config.param_dtype]
    by_file: dict[str, list[TensorSpec]] = {}
    for s in specs:
        by_file.setdefault(files[s.hf_name], []).append(s)
    loaded = []
    for shard, shard_specs in by_file.items():
        with safe_open(shard, framework="numpy") as fh:
            for s in shard_specs:
                # Cast in the HF layout first (halves the transpose copy when down-casting), then
                # move to the device; the numpy copies die at the end of the iteration.
                w = s.to_ours(fh.get_tensor(s.hf_name).astype(np_dtype, copy=False))
                loaded.append((s.path, variables[s.path].replace(jnp.asarray(w))))
                del w
    if len(loaded) != len(variables):
        left = sorted(set(variables) - {p for p, _ in loaded}, key=str)
        raise AssertionError(f"internal: specjax parameters without an HF tensor: {left}")
    return config, nnx.from_flat_state(loaded)


def load_model(path: Union[str, os.PathLike], *, dtype: Optional[str] = None,
               strict: bool = True) -> Transformer:
    """:func:`load_hf_checkpoint` merged into a :class:`Transformer`."""
    config, state = load_hf_checkpoint(path, dtype=dtype, strict=strict)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------
def _flat_params(model_or_state) -> dict[tuple, Any]:
    """``path -> array`` of a Transformer, an nnx.State, or its pure-dict form."""
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state, nnx.Param)
    elif isinstance(model_or_state, nnx.State):
        state = model_or_state
    elif isinstance(model_or_state, dict):
        state = nnx.State(model_or_state)
    else:
        raise TypeError(f"expected a Transformer, nnx.State or dict, got "
                        f"{type(model_or_state).__name__}")
    return {tuple(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
            for p, v in nnx.to_flat_state(state)}


def save_hf_checkpoint(model_or_state, config: Optional[ModelConfig], path: Union[str, os.PathLike],
                       *, max_shard_bytes: Optional[int] = None,
                       extra_config: Optional[dict] = None) -> list[str]:
    """Exports parameters as an HF checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads.

    Args:
      model_or_state: a :class:`Transformer`, its ``nnx.State`` or the state's pure dict.
      config: the model's config (may be None when a Transformer is given).
      path: output directory (created). Old ``model*.safetensors`` / index files there are removed
        first so that a stale shard can never be picked up.
      max_shard_bytes: None writes one ``model.safetensors``; otherwise shards of at most this many
        bytes (a larger single tensor gets its own shard) plus ``model.safetensors.index.json``.
        Host memory holds one shard at a time.
      extra_config: keys merged into config.json (e.g. ``{"eos_token_id": 0}``).
    Returns:
      The written file names.
    """
    if config is None:
        if not isinstance(model_or_state, Transformer):
            raise ValueError("config is required unless a Transformer is given")
        config = model_or_state.config
    path = os.fspath(path)
    flat = _flat_params(model_or_state)
    specs = hf_tensor_specs(config)
    missing = [s.path for s in specs if s.path not in flat]
    if missing:
        raise ValueError(f"parameters missing for config {config}: {missing}")
    for s in specs:
        if tuple(flat[s.path].shape) != s.shape:
            raise ValueError(f"parameter {s.path}: expected shape {s.shape}, "
                             f"got {tuple(flat[s.path].shape)}")
    np_dtype = _NP_DTYPES[config.param_dtype]
    itemsize = np.dtype(np_dtype).itemsize

    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        nbytes = int(np.prod(s.hf_shape)) * itemsize
        if max_shard_bytes is not None and groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += nbytes

    os.makedirs(path, exist_ok=True)
    for fname in os.listdir(path):
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", fname):
            os.remove(os.path.join(path, fname))
    n = len(groups)
    names = [SINGLE_NAME] if max_shard_bytes is None else [
        f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map, total = {}, 0
    for fname, group in zip(names, groups):
        tensors = {}
        for s in group:
            w = np.asarray(jax.device_get(flat[s.path])).astype(np_dtype, copy=False)
            tensors[s.hf_name] = np.ascontiguousarray(s.to_hf(w))
            weight_map[s.hf_name] = fname
            total += tensors[s.hf_name].nbytes
        # "format": "pt" is what transformers checks for in safetensors metadata.
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        del tensors
    written = list(names)
    if max_shard_bytes is not None:
        with open(os.path.join(path, INDEX_NAME), "w", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
        written.append(INDEX_NAME)
    with open(os.path.join(path, CONFIG_NAME), "w", encoding="utf-8") as fh:
        json.dump(config_to_hf(config, **(extra_config or {})), fh, indent=2, sort_keys=True)
    written.append(CONFIG_NAME)
    return written


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def load_tokenizer_json(path: Union[str, os.PathLike], **kwargs):
    """Loads an HF ``tokenizer.json`` (file or checkpoint directory) as a specjax Tokenizer.

    Delegates to :func:`specjax.data.tokenizer.load_tokenizer` (``eos_token`` / ``pad_token``
    keyword arguments are passed through); ``.hf`` is the raw ``tokenizers.Tokenizer``.
    """
    from specjax.data.tokenizer import load_tokenizer  # Lazy: keeps model imports light.
    return load_tokenizer(path, **kwargs)
