"""A drafter run's parts, from its config: the ``"drafter"`` task's config fields and their checks,
the drafter they describe, and the frozen target it is trained against.

* :func:`drafter_defaults` / :func:`validate_task`: ``config.task`` (see
  :mod:`specjax.training.drafter_task` for what each field does in training);
* :func:`build_drafter`: the static drafter (MTP, DSpark, DFlash or draft LM) and a factory for its
  trainable module;
* :func:`target_abstract_params` / :func:`load_target`: the target's graphdef and its parameters,
  abstract (shapes and shardings, no allocation) or restored from a trainer workdir.
"""
from __future__ import annotations

from typing import Optional

import jax
import ml_collections
from flax import nnx

from specjax.drafters import DraftLMDrafter, DSparkConfig, DSparkDrafter, MTPConfig, MTPDrafter
from specjax.drafters.dspark import DSparkModule
from specjax.drafters.mtp import MTPHeads
from specjax.models import ModelConfig, Transformer
from specjax.training.checkpoint import restore_params, run_checkpoints_dir
from specjax.training.errors import ConfigError

__all__ = ["LOSSES", "DRAFTERS", "POSITION_WEIGHTS", "build_drafter", "drafter_defaults",
           "load_target", "logical_axes_of", "target_abstract_params", "validate_task"]

LOSSES = ("ce", "kl", "rkl", "tv", "e2e_tv", "dspark")
DRAFTERS = ("mtp", "dspark", "dflash", "draft_lm")
POSITION_WEIGHTS = ("uniform", "exp")


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes_of(abstract_state) -> dict:
    """The logical axis names of every parameter of an (abstract) nnx state, as a pure dict."""
    axes = jax.tree.map(lambda v: tuple(v.logical_axes), abstract_state, is_leaf=_is_var)
    return nnx.to_pure_dict(axes)


def _opt(value: int) -> Optional[int]:
    return value if value > 0 else None


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------
def drafter_defaults() -> ml_collections.ConfigDict:
    """``config.task`` fields of the drafter task (besides ``name``)."""
    c = ml_collections.ConfigDict()
    c.drafter = "mtp"  # mtp | dspark | dflash | draft_lm
    c.gamma = 3  # draft length γ trained (teacher-forced chain / block size)
    c.loss = "ce"  # ce | kl | rkl | tv | e2e_tv | dspark
    c.warm_start_loss = ""  # "" or a loss used for the first switch_step steps (e.g. "ce")
    c.switch_step = 0
    c.position_weights = "uniform"  # per-position losses: uniform | exp (w_k = exp(-(k-1)/γ))
    c.anchors_per_row = 0  # A anchors sampled per row and step; 0 = every position
    c.target_temperature = 1.0  # p = softmax(target_logits / T)
    c.target_workdir = ""  # the target's trainer workdir (<dir>/checkpoints); "" = random target
    c.target_step = -1  # checkpoint step of the target (-1 = newest)
    c.target_seed = 0  # init seed of the random target when target_workdir == "" (tests only)
    c.init_from = ""  # a drafter run's workdir to warm-start params from ("" = fresh init)
    c.data_file = ""  # .npz token rows (specjax.training.drafter_data); "" = config.data pipeline
    c.eval_file = ""  # .npz held-out rows per domain for eval ("" = config.data's eval batches)
    # loss coefficients of the DSpark objective
    c.dspark_loss = ml_collections.ConfigDict()
    c.dspark_loss.ce_coef = 0.1
    c.dspark_loss.l1_coef = 0.9
    c.dspark_loss.conf_coef = 1.0
    # architectures (0 = the target's value)
    c.mtp = ml_collections.ConfigDict()
    c.mtp.num_heads = 1
    c.mtp.shared = False
    c.mtp.target_layer = -1
    c.mtp.intermediate_size = 0
    c.mtp.num_attention_heads = 0
    c.mtp.num_kv_heads = 0
    c.mtp.head_dim = 0
    c.dspark = ml_collections.ConfigDict()
    c.dspark.target_layers = "-1"  # comma-separated target layers for the context features
    c.dspark.num_layers = 1
    c.dspark.head = "markov"  # markov | rnn | none (ignored for drafter == "dflash": none)
    c.dspark.rank = 32
    c.dspark.confidence = True  # (ignored for drafter == "dflash": False)
    c.dspark.intermediate_size = 0
    c.dspark.num_attention_heads = 0
    c.dspark.num_kv_heads = 0
    c.dspark.head_dim = 0
    c.draft_lm = ml_collections.ConfigDict()
    c.draft_lm.num_layers = 1
    c.draft_lm.hidden_size = 0
    c.draft_lm.intermediate_size = 0
    c.draft_lm.num_heads = 0
    c.draft_lm.num_kv_heads = 0
    c.draft_lm.head_dim = 0
    return c


def validate_task(t: dict) -> None:
    """Raises :class:`ConfigError` naming the first invalid ``config.task`` field."""
    def bad(field, msg):
        raise ConfigError(f"config.task.{field}: {msg}")

    if t["drafter"] not in DRAFTERS:
        bad("drafter", f"must be one of {DRAFTERS}, got {t['drafter']!r}")
    if t["loss"] not in LOSSES:
        bad("loss", f"must be one of {LOSSES}, got {t['loss']!r}")
    if t["warm_start_loss"] not in ("",) + LOSSES:
        bad("warm_start_loss", f"must be '' or one of {LOSSES}, got {t['warm_start_loss']!r}")
    if t["warm_start_loss"] and t["switch_step"] <= 0:
        bad("switch_step", "must be > 0 when warm_start_loss is set")
    if t["switch_step"] < 0:
        bad("switch_step", f"must be >= 0, got {t['switch_step']}")
    if t["gamma"] < 1:
        bad("gamma", f"must be >= 1, got {t['gamma']}")
    if t["anchors_per_row"] < 0:
        bad("anchors_per_row", f"must be >= 0, got {t['anchors_per_row']}")
    if t["position_weights"] not in POSITION_WEIGHTS:
        bad("position_weights", f"must be one of {POSITION_WEIGHTS}")
    if not t["target_temperature"] > 0:
        bad("target_temperature", "must be > 0")
    if t["dspark"]["head"] not in ("markov", "rnn", "none"):
        bad("dspark.head", f"must be markov | rnn | none, got {t['dspark']['head']!r}")
    try:
        _layers(t["dspark"]["target_layers"])
    except ValueError:
        bad("dspark.target_layers", f"comma-separated ints, got {t['dspark']['target_layers']!r}")


def _layers(s: str) -> tuple[int, ...]:
    out = tuple(int(x) for x in str(s).split(",") if x.strip())
    if not out:
        raise ValueError(s)
    return out


# ------------------------------------------------------------------------------------------------
# building drafters / loading the target
# ------------------------------------------------------------------------------------------------
def build_drafter(task_config, target_config: ModelConfig):
    """``(drafter, module_factory)``: the static drafter (graphdef from an abstract module) and
    ``module_factory(rngs) -> nnx.Module`` creating its trainable module."""
    t = task_config
    kind = t.drafter
    if kind == "mtp":
        m = t.mtp
        cfg = MTPConfig(num_heads=m.num_heads, shared=m.shared, target_layer=m.target_layer,
                        intermediate_size=_opt(m.intermediate_size),
                        num_attention_heads=_opt(m.num_attention_heads),
                        num_kv_heads=_opt(m.num_kv_heads), head_dim=_opt(m.head_dim))
        n = 1 if cfg.shared else cfg.num_heads
        factory = lambda rngs: MTPHeads(cfg.block_config(target_config), n, rngs=rngs)
        graphdef = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(params=0))))[0]
        return MTPDrafter(cfg, target_config, graphdef), factory
    if kind in ("dspark", "dflash"):
        d = t.dspark
        head, conf = (("none", False) if kind == "dflash" else (d.head, d.confidence))
        cfg = DSparkConfig(target_layers=_layers(d.target_layers), num_layers=d.num_layers,
                           head=head, rank=d.rank, confidence=conf,
                           intermediate_size=_opt(d.intermediate_size),
                           num_attention_heads=_opt(d.num_attention_heads),
                           num_kv_heads=_opt(d.num_kv_heads), head_dim=_opt(d.head_dim))
        factory = lambda rngs: DSparkModule(cfg, cfg.block_config(target_config),
                                            target_config.vocab_size, rngs=rngs)
        graphdef = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(params=0))))[0]
        drafter = DSparkDrafter(cfg, target_config, graphdef)
        drafter.hidden_layers  # validates the layer indices
        return drafter, factory
    if kind == "draft_lm":
        d = t.draft_lm
        over = {k: getattr(d, k) for k in ("num_layers", "hidden_size", "intermediate_size",
                                           "num_heads", "num_kv_heads", "head_dim")
                if getattr(d, k) > 0}
        cfg = target_config.replace(**over)
        factory = lambda rngs: Transformer(cfg, rngs=rngs)
        graphdef = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(params=0))))[0]
        return DraftLMDrafter(cfg, graphdef), factory
    raise ValueError(f"unknown drafter {kind!r}")


def target_abstract_params(target_config: ModelConfig, sharding=None):
    """``(graphdef, abstract pure-dict params, logical axes)`` of the target; leaves carry
    ``sharding`` (default: the first local device)."""
    abstract = nnx.eval_shape(lambda: Transformer(target_config, rngs=nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    pure = nnx.to_pure_dict(state)
    pure = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), pure)
    return graphdef, pure, logical_axes_of(state)


def load_target(target_config: ModelConfig, workdir: str = "", *, step: int = -1, seed: int = 0):
    """``(graphdef, params)`` of the target: restored from ``<workdir>/checkpoints`` (params only),
    or freshly initialised from ``seed`` when ``workdir`` is empty (tests)."""
    graphdef, abstract, _ = target_abstract_params(target_config)
    if not workdir:
        model = Transformer(target_config, rngs=nnx.Rngs(params=seed))
        return graphdef, nnx.to_pure_dict(nnx.state(model))
    directory = run_checkpoints_dir(workdir)
    return graphdef, restore_params(directory, abstract, None if step < 0 else step)
