"""Pretrain the embedded default target: preset "small" on the embedded math/code/prose corpus.

Run (from the repository root)::

    python -m experiments.train --config experiments/configs/pretrain_target.py \
        --workdir runs/pretrain_target

Tiny mode (a few steps on a 30-document subset, for tests / CI; seconds after data prep)::

    python -m experiments.train --config experiments/configs/pretrain_target.py:tiny \
        --workdir runs/pretrain_target_tiny

Larger target (preset ``base50m`` on the embedded 2048-token vocabulary: 12 layers, d=512,
38.8M parameters; its f32 weights, 155 MB, do not fit a CPU's last-level cache, so a decode step
reads them from memory and a K-token verification adds arithmetic on weights already loaded;
benchmarks/spec_vs_plain.py measures what that buys)::

    python -m experiments.train --config experiments/configs/pretrain_target.py:base \
        --workdir runs/pretrain_target_base

Math stage (continued training of a finished target on the math domain alone, fresh optimizer:
a policy that solves enough of the embedded problems for GRPO's groups to carry a signal;
docs/RL.md)::

    python -m experiments.train --config experiments/configs/pretrain_target.py:math \
        --config.task.init_from runs/pretrain_target --workdir runs/pretrain_target_math

Re-running with the same workdir resumes (or, when finished, just re-evaluates). The corpus is
prepared once (BPE tokenizer with the model's vocabulary + TFDS array_record) under
``~/.cache/specjax/data/vocab2048`` (override with ``--config.data.data_dir`` or
``$SPECJAX_DATA_DIR``).

Sizing: see docs/TRAINING.md.
"""
from specjax.training.config import default_config


def get_config(arg: str | None = None):
    """``arg``: None / "" for the full run, "base" for the larger target, "math" for a math-only
    continued-training stage of a finished target (``--config.task.init_from``), "tiny" for a
    few-step smoke run."""
    if arg not in (None, "", "tiny", "base", "math"):
        raise ValueError(f"pretrain_target: unknown mode {arg!r}; use '', 'base', 'math' or "
                         f"'tiny'")
    c = default_config()
    c.seed = 0
    c.model.preset = "small"  # 4 layers, d=256, 4 heads (2 kv), vocab 2048: 3.67M params

    c.data.kind = "embedded"
    c.data.seq_len = 256
    # 8 x 256 = 2048 tokens per step. At equal tokens (820k) and equal CPU time, batch 8 x 400
    # steps beat batch 32 x 100 steps by 0.2-0.56 nats per domain (docs/TRAINING.md).
    c.data.batch_size = 8
    c.data.eval_batches = -1  # the whole held-out split of each domain (~140k tokens in all)

    c.train.num_steps = 400
    c.train.log_every = 10
    c.train.eval_every = 0  # held-out eval once, at the end

    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 20
    c.optimizer.end_lr_ratio = 0.1
    c.optimizer.weight_decay = 0.1
    c.optimizer.clip_norm = 1.0

    c.checkpoint.every = 100
    c.checkpoint.keep = 2

    if arg == "base":
        c.model.preset = "base50m"
        c.model.overrides.vocab_size = 2048  # the embedded tokenizer: 38.8M parameters
        c.train.num_steps = 600
        c.optimizer.learning_rate = 1e-3  # a lower peak rate for the deeper, wider model (not tuned)
        c.optimizer.warmup_steps = 40
        c.checkpoint.every = 25  # hours on a CPU: resumable at a fine grain

    if arg == "math":
        c.task.init_from = "runs/pretrain_target"  # the full run's workdir (override)
        c.data.train_domains = "math"
        c.train.num_steps = 400
        c.optimizer.learning_rate = 1e-3
        c.optimizer.warmup_steps = 20

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
