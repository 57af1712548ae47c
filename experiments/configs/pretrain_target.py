"""Pretrain the embedded default target: preset "small" on the embedded math/code/prose corpus.

Run (from the repository root)::

    python -m experiments.train --config experiments/configs/pretrain_target.py \
        --workdir /tmp/specjax/pretrain_target

Tiny mode (a few steps on a 30-document subset, for tests / CI; seconds after data prep)::

    python -m experiments.train --config experiments/configs/pretrain_target.py:tiny \
        --workdir /tmp/specjax/pretrain_target_tiny

Re-running with the same workdir resumes (or, when finished, just re-evaluates). The corpus is
prepared once (BPE tokenizer with the model's vocabulary + TFDS array_record) under
``~/.cache/specjax/data/vocab2048`` (override with ``--config.data.data_dir`` or
``$SPECJAX_DATA_DIR``).

Sizing: see docs/TRAINING.md.
"""
from specjax.training.config import default_config


def get_config(arg: str | None = None):
    """``arg``: None / "" for the full run, "tiny" for a few-step smoke run."""
    if arg not in (None, "", "tiny"):
        raise ValueError(f"pretrain_target: unknown mode {arg!r}; use '' or 'tiny'")
    c = default_config()
    c.seed = 0
    c.model.preset = "small"  # 4 layers, d=256, 4 heads (2 kv), vocab 2048: 3.67M params

    c.data.kind = "embedded"
    c.data.seq_len = 256
    c.data.batch_size = 32
    c.data.eval_batches = 8  # per domain: up to 8 x 32 x 256 held-out tokens

    c.train.num_steps = 300
    c.train.log_every = 10
    c.train.eval_every = 0  # held-out eval once, at the end

    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 20
    c.optimizer.end_lr_ratio = 0.1
    c.optimizer.weight_decay = 0.1
    c.optimizer.clip_norm = 1.0

    c.checkpoint.every = 50
    c.checkpoint.keep = 2

    if arg == "tiny":
        c.model.preset = "tiny"
        c.model.overrides.vocab_size = 2048  # same tokenizer family as the full run
        c.data.max_docs = 30
        c.data.seq_len = 64
        c.data.batch_size = 8
        c.data.eval_batches = 1
        c.train.num_steps = 4
        c.train.log_every = 2
        c.optimizer.warmup_steps = 1
        c.checkpoint.every = 2
    return c
