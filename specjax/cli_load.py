"""What ``specjax serve`` / ``specjax eval`` load: the target, the drafter, the tokenizer, and the
engine configuration, with clear errors for combinations that cannot work.

Targets (exactly one source):

* ``hf_dir``: a local Hugging Face checkpoint (Qwen3 / Llama safetensors,
  :mod:`specjax.models.hf_io`);
* ``target_workdir``: a specjax trainer workdir (``config.json`` + ``checkpoints/``, e.g. from
  ``python -m experiments.train --config experiments/configs/pretrain_target.py``);
* neither, with a drafter workdir: the target that drafter was trained against (its
  ``config.task.target_workdir``);
* neither and no drafter workdir: a random model of ``preset`` (smoke tests).

Drafters: ``"ngram"`` (prompt lookup, no weights), or a drafter run's workdir written by
``python -m experiments.train_drafter`` (MTP, DSpark, DFlash, draft LM;
:func:`specjax.training.drafter_run.load_drafter` reads its ``config.json`` and newest checkpoint).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Optional

# Policies a user may choose. "retrospective" (the global search without early stop) is left out
# on purpose: it looks at the drafts it admits, so its output distribution is biased.
SERVE_POLICIES = ("none", "fixed", "mtp1", "threshold", "dspark", "production")
CONFIDENCE_POLICIES = ("threshold", "dspark", "production")
PROFILED_POLICIES = ("dspark", "production")  # need the measured SPS(B) table
METHODS = ("rejection", "target_only")
# Target fields a trained drafter depends on: the shared embedding / final norm / LM head (MTP,
# DSpark, DFlash) and the hidden states it reads.
_SHARED_FIELDS = ("vocab_size", "hidden_size", "num_layers", "tie_embeddings")


class LoadError(ValueError):
    """A bad flag or combination of flags (the message says which and why)."""


@dataclasses.dataclass
class Loaded:
    """A target and drafter ready for :class:`specjax.engine.Engine`.

    target: ``(graphdef, params)``. model_config: the target's ModelConfig. drafter / params /
    frozen: as the engine takes them. gamma: the drafter's trained γ (4 for the n-gram drafter).
    tokenizer: a :class:`specjax.data.tokenizer.Tokenizer` or ``None``. prepend_eos: text prompts
    start with the EOS id (the document separator a specjax target was trained with).
    drafter_name: for reports.
    """

    target: tuple
    model_config: Any
    drafter: Any
    params: Any
    frozen: Any
    gamma: int
    tokenizer: Any
    prepend_eos: bool
    drafter_name: str

    def model(self):
        """The target as an nnx :class:`~specjax.models.Transformer` (for plain decoding)."""
        from flax import nnx
        return nnx.merge(*self.target)


def _read_config(workdir: str, what: str):
    from specjax.training.config import validate_config
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise LoadError(f"{what} {workdir!r}: no config.json (not a specjax trainer workdir)")
    with open(path) as f:
        return validate_config(json.load(f))


def _target_from_workdir(workdir: str):
    from specjax.training.drafter_task import load_target
    from specjax.training.lm_task import model_config_from
    config = _read_config(workdir, "--target-workdir")
    if config.task.name != "lm":
        raise LoadError(f"--target-workdir {workdir!r} is a {config.task.name!r} run, not a "
                        f"target (language model) run")
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise LoadError(f"--target-workdir {workdir!r}: no checkpoints/")
    mcfg = model_config_from(config)
    return load_target(mcfg, workdir), mcfg, config


def _tokenizer_of_run(config, vocab_size: int) -> Optional[str]:
    """The tokenizer.json a specjax run trained with (embedded corpus), when it is on disk."""
    if config.data.kind != "embedded":
        return None
    from specjax.training.run import data_dir_of
    path = os.path.join(data_dir_of(config, vocab_size), "tokenizer.json")
    return path if os.path.isfile(path) else None


def check_compatible(drafter_target, target_config, what: str) -> None:
    """Raises :class:`LoadError` when a drafter trained against ``drafter_target`` (ModelConfig)
    cannot run on ``target_config``; ``what`` names the drafter in the message."""
    diff = {f: (getattr(drafter_target, f), getattr(target_config, f)) for f in _SHARED_FIELDS
            if getattr(drafter_target, f) != getattr(target_config, f)}
    if diff:
        parts = ", ".join(f"{f}: drafter's target {a} vs target {b}" for f, (a, b) in diff.items())
        raise LoadError(f"{what} was trained against a different target architecture ({parts})")


def load(*, hf_dir: Optional[str] = None, target_workdir: Optional[str] = None,
         preset: str = "tiny", drafter: str = "ngram", tokenizer: Optional[str] = None,
         prepend_eos: Optional[bool] = None, seed: int = 0, dtype: Optional[str] = None) -> Loaded:
    """Loads target, drafter and tokenizer (see the module docstring).

    ``drafter``: ``"ngram"`` or a drafter workdir. ``tokenizer``: a ``tokenizer.json`` (default:
    the one next to an HF checkpoint, or the one a specjax target trained with, when present).
    ``prepend_eos``: default true for specjax targets, false for HF checkpoints.
    """
    from flax import nnx

    from specjax.drafters import NGramDrafter, shared_head
    if hf_dir and target_workdir:
        raise LoadError("give one of --hf-dir and --target-workdir, not both")
    run_config = None
    if hf_dir:
        if not os.path.isdir(hf_dir):
            raise LoadError(f"--hf-dir {hf_dir!r} is not a directory")
        from specjax.models.hf_io import load_model
        model = load_model(hf_dir, dtype=dtype)
        target, mcfg = nnx.split(model), model.config
        if tokenizer is None and os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
            tokenizer = os.path.join(hf_dir, "tokenizer.json")
    elif target_workdir:
        target, mcfg, run_config = _target_from_workdir(target_workdir)
    else:
        target = mcfg = None

    if drafter == "ngram":
        if target is None:
            from specjax.models import get_preset, init_model
            model = init_model(get_preset(preset), seed=seed)
            target, mcfg = nnx.split(model), model.config
        d, params, frozen, gamma, name = NGramDrafter(mcfg.vocab_size), None, None, 4, "ngram"
    else:
        if not os.path.isdir(drafter):
            raise LoadError(f"--drafter {drafter!r}: not 'ngram' and not a directory")
        dconfig = _read_config(drafter, "--drafter")
        if dconfig.task.name != "drafter":
            raise LoadError(f"--drafter {drafter!r} is a {dconfig.task.name!r} run, not a drafter "
                            f"run (experiments.train_drafter)")
        from specjax.training.drafter_run import load_drafter
        d, params, task = load_drafter(drafter)
        name = f"{dconfig.task.drafter}:{os.path.basename(os.path.normpath(drafter))}"
        if target is None:
            twd = dconfig.task.target_workdir
            if twd:
                if not os.path.isdir(twd):
                    raise LoadError(f"the drafter's target workdir {twd!r} (from its config.json) "
                                    f"does not exist; pass --target-workdir or --hf-dir")
                target, mcfg, run_config = _target_from_workdir(twd)
            else:  # trained against a random target (tests): the same one
                target, mcfg = task.frozen_target(), task.target_config
                run_config = dconfig
        check_compatible(task.target_config, mcfg, f"--drafter {drafter!r}")
        frozen = shared_head(target) if task.uses_head else None
        gamma = task.gamma

    if tokenizer is None and run_config is not None:
        tokenizer = _tokenizer_of_run(run_config, mcfg.vocab_size)
    tok = None
    if tokenizer:
        from specjax.data.tokenizer import load_tokenizer
        tok = load_tokenizer(tokenizer)
        if tok.vocab_size > mcfg.vocab_size:
            raise LoadError(f"tokenizer {tokenizer!r} has {tok.vocab_size} tokens but the target's "
                            f"vocabulary is {mcfg.vocab_size}")
    if prepend_eos is None:
        prepend_eos = not hf_dir
    return Loaded(target, mcfg, d, params, frozen, gamma, tok, bool(prepend_eos), name)


def engine_config(loaded: Loaded, *, policy: str, method: str = "rejection",
                  gamma: Optional[int] = None, k: Optional[int] = None, threshold: float = 0.5,
                  stale_decay: Optional[float] = None, slots: int = 8, max_len: int = 512,
                  seed: int = 0,
                  sps_cache: Optional[str] = None, profile_reps: int = 5, filters: bool = True,
                  prefill_buckets="16,64,256", token_buckets=None, loop: str = "device",
                  loop_steps: int = 16, online_calibration: bool = False,
                  row_buckets="none"):
    """An :class:`~specjax.engine.EngineConfig` for the loaded drafter, or :class:`LoadError`.

    ``gamma`` defaults to the drafter's trained γ; ``k`` (policy "fixed") defaults to γ.
    ``stale_decay`` (policy "production"): ``SchedulerConfig.stale_decay``; None: its default.
    ``filters=False`` compiles without top-k / top-p support (temperature-only requests, faster).
    ``prefill_buckets`` / ``token_buckets``: compiled prompt chunk sizes / verification batch
    sizes, sequences or comma-separated strings (``token_buckets=None``: the engine's default).
    ``loop`` / ``loop_steps``: the engine's device loop (default) or host loop.
    ``online_calibration``: confidence policies read confidences calibrated on the verifier's
    past decisions (device loop; :mod:`specjax.engine.online_calibration`).
    ``row_buckets``: "auto", "none" or comma-separated row counts: device-loop calls and
    admissions run on the active slots only, padded to the smallest of these
    (:mod:`specjax.engine.loop_rows`); ignored by the host loop.
    """
    from specjax.engine import EngineConfig
    from specjax.engine.requests import parse_row_buckets
    from specjax.scheduling import SchedulerConfig
    if policy not in SERVE_POLICIES:
        raise LoadError(f"--policy must be one of {SERVE_POLICIES}, got {policy!r}")
    if method not in METHODS:
        raise LoadError(f"--method must be one of {METHODS}, got {method!r}")
    gamma = loaded.gamma if gamma is None else gamma
    if gamma < 1:
        raise LoadError(f"--gamma must be >= 1, got {gamma}")
    if policy in CONFIDENCE_POLICIES and not loaded.drafter.has_confidence:
        raise LoadError(
            f"--policy {policy} schedules by draft confidences, but the drafter "
            f"({loaded.drafter_name}) has no confidence head; use a DSpark drafter trained with "
            f"a confidence head, or --policy fixed / mtp1 / none")
    k = gamma if k is None else k
    if policy == "fixed" and not 1 <= k <= gamma:
        raise LoadError(f"--k must be in [1, gamma={gamma}] for --policy fixed, got {k}")
    if not 0 <= threshold <= 1:
        raise LoadError(f"--threshold must be in [0, 1], got {threshold}")
    stale_decay = SchedulerConfig.stale_decay if stale_decay is None else stale_decay
    if not 0 <= stale_decay <= 1:
        raise LoadError(f"--stale-decay must be in [0, 1], got {stale_decay}")
    try:
        prefill_buckets = _ints(prefill_buckets)
        token_buckets = None if token_buckets is None else _ints(token_buckets)
        row_buckets = parse_row_buckets(row_buckets) if loop == "device" else ()
        return EngineConfig(num_slots=slots, max_len=max_len, gamma=gamma, method=method,
                            scheduler=SchedulerConfig(policy, k=k, threshold=threshold,
                                                      stale_decay=stale_decay), seed=seed,
                            prefill_buckets=prefill_buckets, token_buckets=token_buckets,
                            sps_cache=sps_cache, profile_reps=profile_reps, filters=filters,
                            loop=loop, loop_steps=loop_steps,
                            online_calibration=online_calibration, row_buckets=row_buckets)
    except ValueError as e:
        raise LoadError(str(e)) from e


def _ints(values) -> tuple:
    if isinstance(values, str):
        values = values.split(",")
    return tuple(int(v) for v in values if str(v).strip())


def make_engine(loaded: Loaded, config, *, progress: bool = True):
    """The engine, compiled (and SPS-profiled when the policy needs it), with a warm-up progress
    bar on stderr (one tick per compiled program or profile; off with ``progress=False``)."""
    from tqdm.auto import tqdm

    from specjax.engine import Engine
    engine = Engine(loaded.target, loaded.drafter, loaded.params, loaded.frozen, config)
    bar = None

    def tick(done: int, total: int, label: str) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc="warm-up", file=sys.stderr, dynamic_ncols=True)
        bar.set_postfix_str(label, refresh=False)
        bar.update(1)

    try:
        engine.warmup(profile=config.scheduler.policy in PROFILED_POLICIES,
                      progress=tick if progress else None)
    finally:
        if bar is not None:
            bar.close()
    return engine


def encode_prompt(loaded: Loaded, text: str) -> list[int]:
    """Token ids of a text prompt (EOS first when ``loaded.prepend_eos``)."""
    if loaded.tokenizer is None:
        raise LoadError("a text prompt needs a tokenizer (--tokenizer), or send token ids")
    ids = loaded.tokenizer.encode(text)
    return [loaded.tokenizer.eos_id] + ids if loaded.prepend_eos else ids
