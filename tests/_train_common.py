"""Shared by the training tests and their subprocess worker: the tiny synthetic-data config, a
reference iterator that concatenates several processes' shards, and the training command line run
as a user runs it (not a test module)."""
import os
import subprocess
import sys

import numpy as np
from _xla_flags import without_device_count

from specjax.training import SyntheticLMIterator, default_config


def base_config(overrides=None):
    """Tiny model, T=32, global batch 8, synthetic data, checkpoints every 2 of 8 steps."""
    c = default_config()
    c.model.preset = "tiny"
    c.data.seq_len = 32
    c.data.batch_size = 8
    c.train.num_steps = 8
    c.train.log_every = 1
    c.optimizer.learning_rate = 1e-2
    c.optimizer.warmup_steps = 2
    c.checkpoint.every = 2
    c.checkpoint.keep = 10
    c.output.progress_bar = False
    c.output.plot = False
    for dotted, value in (overrides or {}).items():
        node = c
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


class ConcatIterator:
    """Rows of shards 0..n-1 of the synthetic stream, stacked in shard order: what the global
    batch of n processes (each reading its own shard) looks like to a single process."""

    def __init__(self, n, **kw):
        self.parts = [SyntheticLMIterator(shard_index=i, num_shards=n, **kw) for i in range(n)]

    def __next__(self):
        batches = [next(p) for p in self.parts]
        return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

    def get_state(self):
        return [p.get_state() for p in self.parts]

    def set_state(self, state):
        for p, s in zip(self.parts, state):
            p.set_state(s)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_cli(*args, timeout=300):
    """``python -m experiments.train ARGS`` from the repository root, as a completed process
    (stdout / stderr captured as text). It sees one CPU device, as a user's run does: the suite's
    fake device count is taken out of XLA_FLAGS; its compile-speed flags stay."""
    env = dict(os.environ, XLA_FLAGS=without_device_count(os.environ.get("XLA_FLAGS", "")))
    return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
