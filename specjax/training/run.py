"""One training run from a config: distributed start-up, inputs, trainer, summary.

``experiments/train.py`` is a thin command line around :func:`run`; notebooks and the quickstart
call :func:`run` directly. The input pipeline is chosen by ``config.data.kind``:

* ``"synthetic"`` — :class:`~specjax.training.inputs.SyntheticLMIterator` (tests, smoke runs);
* ``"embedded"``  — :mod:`specjax.data`: the embedded math/code/prose corpus, prepared once
  (BPE tokenizer + TFDS array_record) under ``config.data.data_dir`` and streamed by its grain
  pipeline, sharded by process; held-out batches per domain for evaluation.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax
import ml_collections

from specjax.training import distributed
from specjax.training.config import train_domain_names, validate_config
from specjax.training.inputs import SyntheticLMIterator
from specjax.training.lm_task import model_config_from
from specjax.training.trainer import Trainer, TrainState

DEFAULT_DATA_DIR = os.path.join(os.path.expanduser("~"), ".cache", "specjax", "data")


@dataclasses.dataclass
class RunResult:
    """What :func:`run` hands back.

    trainer: the :class:`Trainer` (its ``task``, ``mesh``, ``config``).
    state: the final :class:`TrainState`.
    eval: ``{domain: {"ce": nats/token, "accuracy", "tokens", ...}}`` at the last step.
    tokenizer: the :class:`specjax.data.Tokenizer` for ``data.kind == "embedded"``, else None.
    """

    trainer: Trainer
    state: TrainState
    eval: dict
    tokenizer: Any = None


def data_dir_of(config: ml_collections.ConfigDict, vocab_size: int) -> str:
    """``config.data.data_dir`` if set; else ``<base>/vocab<V>[_first<max_docs>]`` under
    ``$SPECJAX_DATA_DIR`` or ``~/.cache/specjax/data``.

    One prepared data dir holds one tokenizer and one ``max_docs`` subset (preparing another
    rebuilds it), so the default keeps one dir per (vocab, subset) and runs can share a cache.
    """
    if config.data.data_dir:
        return config.data.data_dir
    base = os.environ.get("SPECJAX_DATA_DIR") or DEFAULT_DATA_DIR
    name = f"vocab{vocab_size}" + (f"_first{config.data.max_docs}" if config.data.max_docs else "")
    return os.path.join(base, name)


def make_inputs(config: ml_collections.ConfigDict, vocab_size: int):
    """``(train_iterator, eval_batches, tokenizer)`` for this process.

    Args:
      config: validated config.
      vocab_size: the model's vocabulary (the embedded tokenizer is trained to this size).
    """
    d = config.data
    index, count = jax.process_index(), jax.process_count()
    if d.kind == "synthetic":
        per_host = d.batch_size // count
        train = SyntheticLMIterator(batch_size=per_host, seq_len=d.seq_len, vocab_size=vocab_size,
                                    seed=d.seed, shard_index=index, num_shards=count)
        heldout = SyntheticLMIterator(batch_size=per_host, seq_len=d.seq_len,
                                      vocab_size=vocab_size, seed=d.seed + 10_000,
                                      shard_index=index, num_shards=count)
        num = 4 if d.eval_batches == -1 else d.eval_batches
        evals = {"synthetic": [heldout.batch_at(i) for i in range(num)]}
        return train, (evals if d.eval_batches else None), None

    from specjax import data as data_lib  # heavy imports (tfds, grain) only when needed
    data_dir = data_dir_of(config, vocab_size)
    prepare = dict(vocab_size=vocab_size, max_docs=d.max_docs or None)
    if index == 0:
        prepared = data_lib.prepare_default_data(data_dir, **prepare)
    if count > 1:  # others wait until process 0 has built (or validated) the shared data dir
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("specjax_prepare_default_data")
    if index != 0:
        prepared = data_lib.prepare_default_data(data_dir, verbose=False, **prepare)
    tokenizer = prepared.load_tokenizer()
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"tokenizer in {data_dir} has {tokenizer.vocab_size} tokens but "
                         f"the model's vocab_size is {vocab_size}")
    # Sources are TFDS configs "<dataset>/<config>"; with max_docs the config is e.g.
    # "math_first30", reported under its domain name "math".
    configs = {name.split("/", 1)[1]: domain for domain, name in prepared.dataset_names.items()}
    common = dict(tokenizer=tokenizer, seq_len=d.seq_len, global_batch_size=d.batch_size,
                  data_dir=prepared.data_dir, domains=tuple(configs), process_index=index,
                  process_count=count)
    train_only = train_domain_names(d)
    train_sources = tuple(k for k, dom in configs.items() if not train_only or dom in train_only)
    train = data_lib.make_train_iterator(seed=d.seed, **dict(common, domains=train_sources))
    evals = None
    if d.eval_batches:
        evals = data_lib.make_eval_batches(
            max_batches=None if d.eval_batches == -1 else d.eval_batches, **common)
        evals = {configs[k]: v for k, v in evals.items()}
    return train, evals, tokenizer


def run(config: Any, workdir: str, *, stop_after: Optional[int] = None,
        hooks=()) -> RunResult:
    """Trains ``config`` in ``workdir`` (resuming if it holds checkpoints); returns the result.

    Writes ``workdir/config.json`` (the full validated config), ``metrics.jsonl``,
    ``loss_curve.png`` and ``checkpoints/``. ``stop_after`` / ``hooks``: see
    :meth:`Trainer.train`.
    """
    config = validate_config(config)  # schema errors before any distributed start-up
    distributed.maybe_initialize(config.distributed)
    trainer = Trainer(config, workdir=workdir)
    cfg = trainer.config
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2, sort_keys=True)
    train_iter, evals, tokenizer = make_inputs(cfg, model_config_from(cfg).vocab_size)
    try:
        state = trainer.train(train_iter, evals, stop_after=stop_after, hooks=hooks)
    finally:
        trainer.close()
        close = getattr(train_iter, "close", None)
        if close is not None:
            close()
    return RunResult(trainer=trainer, state=state, eval=trainer.last_eval, tokenizer=tokenizer)


def summary_lines(result: RunResult) -> list[str]:
    """Human-readable held-out numbers, one line per domain."""
    lines = []
    for domain, m in sorted(result.eval.items()):
        lines.append(f"  {domain:>10}: held-out loss {m['ce']:.3f} nats/token, "
                     f"accuracy {m['accuracy']:.3f} ({int(m['tokens'])} tokens)")
    return lines
