"""Training config: the schema of defaults and fail-fast validation.

Experiment configs (``experiments/configs/*.py``) start from :func:`default_config`, which is
*locked*: assigning a misspelt field raises at once, and ``ml_collections`` rejects a value of the
wrong type (e.g. a string for ``train.num_steps``). Configs built any other way (a plain dict, an
unlocked ``ConfigDict``, command-line overrides) go through :func:`validate_config`, which
checks every user-provided field against the schema and fills in the defaults. Errors are
:class:`ConfigError` and name the field (``config.train.num_steps``).

Task-specific fields live under ``config.task``; their schema comes from the task registry
(:mod:`specjax.training.tasks`), so a drafter task adds its own fields without touching this file.
The mesh-versus-devices check needs the device count and so happens in
:func:`validate_config` only when ``num_devices`` is given (after ``jax.distributed`` started).
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Optional

import ml_collections

from specjax.compiler_options import parse_compiler_options
from specjax.training import registry
from specjax.training import sharding as sharding_lib
from specjax.training.errors import ConfigError

__all__ = ["ConfigError", "default_config", "validate_config"]


def default_config(task: str = "lm") -> ml_collections.ConfigDict:
    """The full schema with defaults (locked). ``task`` picks the ``config.task`` sub-schema."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # parameter init and the per-step RNG stream

    # The architecture of the model being trained (for drafter tasks: the frozen target's).
    c.model = ml_collections.ConfigDict()
    c.model.preset = "small"  # specjax.models.PRESETS
    c.model.overrides = ml_collections.ConfigDict()  # ModelConfig fields, checked against it

    c.task = registry.task_defaults(task)

    c.data = ml_collections.ConfigDict()
    c.data.kind = "synthetic"  # "synthetic" (tests) | "embedded" (specjax.data pipeline)
    c.data.data_dir = ""  # embedded: where the TFDS data is prepared/cached ("" = default)
    c.data.max_docs = 0  # embedded: first N documents per domain and split (0 = all; CI)
    # embedded: comma-separated domains to train on ("" = all; e.g. "math" for a math-only
    # continued-training stage); held-out evaluation still reports every domain
    c.data.train_domains = ""
    c.data.seq_len = 256  # T
    c.data.batch_size = 32  # global batch (all processes); per host = batch_size / processes
    c.data.eval_batches = 4  # held-out batches per domain (0 = no eval, -1 = whole split)
    c.data.seed = 0  # shuffling seed of the input pipeline

    c.train = ml_collections.ConfigDict()
    c.train.num_steps = 400
    c.train.grad_accum_steps = 1  # microbatches per step (the global batch is split evenly)
    c.train.log_every = 10  # steps between metric lines / progress-bar updates
    c.train.eval_every = 0  # 0 = evaluate only at the end
    # Activation memory of the trained transformer (specjax.training.memory): jax.checkpoint
    # policy per block ("none" | "full" | "dots" | "all_dots"), and positions per chunk of the
    # vocabulary loss (0 = the whole sequence at once; the logits are then [B, T, V] f32).
    c.train.remat = "none"
    c.train.logits_chunk = 0
    # Queries per chunk of every attention in the loss (0 = all at once): one chunk's
    # [B, H, chunk, T] scores alive at a time, recomputed in the backward pass
    # (specjax.models.attention.query_chunks).
    c.train.attention_chunk = 0
    # XLA / libtpu options for the jitted train and eval steps when they are compiled for TPU
    # (on a TPU VM, and by the experiments.tpu_plan pre-flight; ignored on CPU / GPU), as
    # "name=value,name=value" (specjax.compiler_options), e.g.
    # "xla_tpu_enable_windowed_einsum_for_all_gather=false" (docs/TPU.md, "What fills a v5e-8
    # chip").
    c.train.tpu_compiler_options = ""

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 3e-3  # peak
    c.optimizer.warmup_steps = 20  # linear warmup from 0
    c.optimizer.decay_steps = 0  # cosine decay length after warmup (0 = to num_steps)
    c.optimizer.end_lr_ratio = 0.1  # final LR = ratio * peak
    c.optimizer.weight_decay = 0.1  # AdamW, on >= 2-D parameters only
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.eps = 1e-8
    c.optimizer.clip_norm = 1.0  # global-norm clipping (0 = off)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1  # -1 = all remaining devices
    c.mesh.tensor = 1

    c.sharding = ml_collections.ConfigDict()
    c.sharding.on_indivisible = "error"  # or "replicate" that dimension

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 100  # steps between saves (0 = only at the end; -1 = never)
    c.checkpoint.keep = 3  # newest checkpoints kept
    c.checkpoint.async_save = True
    c.checkpoint.resume = True  # restore the newest complete checkpoint in workdir

    c.distributed = ml_collections.ConfigDict()
    # "auto": initialise when coordinator_address / num_processes are set here or
    # JAX_COORDINATOR_ADDRESS is in the environment; "always": call jax.distributed.initialize()
    # (cluster auto-detection: TPU pods, SLURM, ...); "never".
    c.distributed.initialize = "auto"
    c.distributed.coordinator_address = ""
    c.distributed.num_processes = 0
    c.distributed.process_id = -1

    c.output = ml_collections.ConfigDict()
    c.output.progress_bar = True
    c.output.plot = True  # loss_curve.png in the workdir

    c.lock()
    c.model.overrides.unlock()  # free-form: keys are checked against ModelConfig instead
    return c


_CHOICES = {
    "data.kind": ("synthetic", "embedded"),
    "sharding.on_indivisible": sharding_lib.ON_INDIVISIBLE,
    "distributed.initialize": ("auto", "always", "never"),
    "train.remat": ("none", "full", "dots", "all_dots"),
}
_POSITIVE = ("data.seq_len", "data.batch_size", "train.num_steps", "train.grad_accum_steps",
             "train.log_every", "checkpoint.keep")
_NON_NEGATIVE = ("data.max_docs", "train.eval_every", "train.logits_chunk",
                 "train.attention_chunk", "optimizer.warmup_steps",
                 "optimizer.decay_steps", "optimizer.weight_decay", "optimizer.clip_norm",
                 "optimizer.learning_rate", "optimizer.end_lr_ratio", "distributed.num_processes")
# Subtrees whose keys are not fixed by this schema (checked elsewhere).
_FREE_FORM = ("model.overrides",)


def _type_ok(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if default is None:
        return True
    return isinstance(value, type(default))


def _as_mapping(x: Any) -> Optional[Mapping]:
    if isinstance(x, ml_collections.ConfigDict):
        return x.to_dict()
    if isinstance(x, Mapping):
        return x
    return None


def _merge(user: Mapping, schema: Mapping, prefix: str, out: dict) -> None:
    for key, value in user.items():
        field = f"{prefix}{key}"
        if key not in schema:
            close = difflib.get_close_matches(str(key), [str(k) for k in schema], n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"config.{field}: unknown field{hint}; known fields under "
                              f"'config.{prefix or '.'}': {sorted(map(str, schema))}")
        default = schema[key]
        sub_user, sub_schema = _as_mapping(value), _as_mapping(default)
        if sub_schema is not None:
            if sub_user is None:
                raise ConfigError(f"config.{field}: expected a group of fields, got {value!r}")
            if field in _FREE_FORM:
                out[key] = dict(sub_user)
            else:
                _merge(sub_user, sub_schema, f"{field}.", out.setdefault(key, {}))
        else:
            if sub_user is not None:
                raise ConfigError(f"config.{field}: expected a single {type(default).__name__} "
                                  f"value, got a group of fields")
            if not _type_ok(value, default):
                raise ConfigError(f"config.{field}: expected {type(default).__name__}, got "
                                  f"{type(value).__name__} {value!r}")
            out[key] = float(value) if isinstance(default, float) else value


def _get(tree: Mapping, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _check_model(model: Mapping) -> None:
    from specjax.models import PRESETS, ModelConfig

    preset = model["preset"]
    if preset not in PRESETS:
        raise ConfigError(f"config.model.preset: unknown preset {preset!r}; known: "
                          f"{sorted(PRESETS)}")
    base = PRESETS[preset]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for key, value in model["overrides"].items():
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"config.model.overrides.{key}: not a ModelConfig field{hint}")
        current = getattr(base, key)
        if current is not None and not _type_ok(value, current):
            raise ConfigError(f"config.model.overrides.{key}: expected "
                              f"{type(current).__name__}, got {type(value).__name__} {value!r}")
    try:
        base.replace(**model["overrides"])
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.model.overrides: {e}") from e


def train_domain_names(data) -> set:
    """The domains ``data.train_domains`` names (comma-separated; empty set = every domain)."""
    return {x.strip() for x in data["train_domains"].split(",") if x.strip()}


def validate_config(config: Any, *, num_devices: Optional[int] = None,
                    num_processes: int = 1) -> ml_collections.ConfigDict:
    """Checks ``config`` against the schema and returns a complete, locked ``ConfigDict``.

    Args:
      config: a ``ConfigDict`` or nested mapping; missing fields take their defaults.
      num_devices: global device count; when given, the mesh is checked against it and the
        global batch against the mesh's batch split.
      num_processes: processes in the run (the global batch must split evenly over them).
    Raises:
      ConfigError naming the first offending field.
    """
    user = _as_mapping(config)
    if user is None:
        raise ConfigError(f"config must be a ConfigDict or mapping, got {type(config).__name__}")
    task_name = user.get("task", {}).get("name", "lm") if isinstance(user.get("task"), Mapping) \
        else "lm"
    if task_name not in registry.registered_tasks():
        raise ConfigError(f"config.task.name: unknown task {task_name!r}; registered: "
                          f"{sorted(registry.registered_tasks())}")
    schema = default_config(task_name).to_dict()
    merged = default_config(task_name).to_dict()
    _merge(user, schema, "", merged)

    for field, choices in _CHOICES.items():
        if _get(merged, field) not in choices:
            raise ConfigError(f"config.{field}: must be one of {choices}, got "
                              f"{_get(merged, field)!r}")
    for field in _POSITIVE:
        if _get(merged, field) <= 0:
            raise ConfigError(f"config.{field}: must be > 0, got {_get(merged, field)!r}")
    for field in _NON_NEGATIVE:
        if _get(merged, field) < 0:
            raise ConfigError(f"config.{field}: must be >= 0, got {_get(merged, field)!r}")
    for field in ("checkpoint.every", "data.eval_batches"):
        if _get(merged, field) < -1:
            raise ConfigError(f"config.{field}: must be >= -1, got {_get(merged, field)}")
    if merged["optimizer"]["warmup_steps"] > merged["train"]["num_steps"]:
        raise ConfigError(f"config.optimizer.warmup_steps ({merged['optimizer']['warmup_steps']}) "
                          f"exceeds config.train.num_steps ({merged['train']['num_steps']})")
    _check_model(merged["model"])
    try:
        parse_compiler_options(merged["train"]["tpu_compiler_options"])
    except ValueError as e:
        raise ConfigError(f"config.train.tpu_compiler_options: {e}") from None
    registry.validate_task_config(task_name, merged["task"])
    train_domains = train_domain_names(merged["data"])
    if train_domains:
        from specjax.data.corpus import DOMAINS
        bad = sorted(train_domains - set(DOMAINS))
        if bad or merged["data"]["kind"] != "embedded":
            raise ConfigError(f"config.data.train_domains: needs data.kind 'embedded' and names "
                              f"among {list(DOMAINS)}, got {merged['data']['train_domains']!r}")

    batch = merged["data"]["batch_size"]
    accum = merged["train"]["grad_accum_steps"]
    if batch % accum:
        raise ConfigError(f"config.data.batch_size ({batch}) must be a multiple of "
                          f"config.train.grad_accum_steps ({accum})")
    if batch % num_processes:
        raise ConfigError(f"config.data.batch_size ({batch}) must be a multiple of the number of "
                          f"processes ({num_processes})")
    try:
        sizes = sharding_lib.resolve_mesh_shape(merged["mesh"], num_devices or 1) \
            if num_devices is not None else None
    except sharding_lib.ShardingError as e:
        raise ConfigError(str(e)) from e
    if sizes is not None:
        shards = sizes[0] * sizes[1]  # the batch rule splits rows over data x fsdp
        if (batch // accum) % shards:
            raise ConfigError(
                f"config.data.batch_size / config.train.grad_accum_steps = {batch // accum} rows "
                f"per microbatch must be a multiple of mesh data x fsdp = {shards}")

    out = ml_collections.ConfigDict(merged)
    out.lock()
    return out
