"""Train a drafter against the frozen embedded target (task "drafter", specjax/training/drafter_task.py).

Run (from the repository root; the target is a finished ``pretrain_target.py`` workdir)::

    python -m experiments.train_drafter --config experiments/configs/train_drafter.py:mtp_e2e_tv_ws \
        --config.task.target_workdir runs/pretrain_target \
        --workdir runs/drafter_mtp_e2e_tv_ws

Tiny mode (tiny target from ``pretrain_target.py:tiny``; a few steps, seconds after compilation)::

    python -m experiments.train_drafter --config experiments/configs/train_drafter.py:mtp_tv,tiny \
        --config.task.target_workdir runs/pretrain_target_tiny --workdir runs/d_tiny

Without ``--config.task.data_file`` the drafter trains on the packed embedded pipeline
(``config.data``; labels never cross a document boundary). With
``--config.task.data_file rows.npz --config.task.eval_file heldout.npz`` it trains on one sequence
per row (:mod:`specjax.training.drafter_data`; ``experiments/reproduce.py`` builds these files, and
can regenerate them with the target for self-distillation).

``arg`` = ``<variant>[,tiny]``. Variants:

* ``mtp_<loss>``: one shared MTP head of limited capacity (MLP 256 vs the target's 768), chained
  γ = 3 (Bebop Table 2 setting), loss ``ce | kl | rkl | tv | e2e_tv``, from random init;
* ``mtp_<loss>_ws``: CE for the first half of the steps, then ``<loss>`` (Bebop-style fine-tuning
  of a CE-trained head at equal total budget, one run);
* ``dspark_markov``, ``dspark_rnn``, ``dflash`` (γ = 7) and ``..._g15`` (γ = 15): DSpark §3.3
  training (16 anchors per row, ``0.1·CE + 0.9·L1 + 1.0·BCE(confidence)``, weights
  ``exp(−(k−1)/γ)``; DFlash: same loss, no sequential / confidence head), preceded by forward KL
  for the first half of the steps (a short-budget warm start, the same for all three);
* ``draft_lm``: an independent 1-layer draft LM distilled with forward KL.
"""
from specjax.training.config import default_config
import specjax.training.drafter_task  # noqa: F401  (registers the "drafter" task)

MTP_LOSSES = ("ce", "kl", "rkl", "tv", "e2e_tv")


def get_config(arg: str | None = None):
    parts = [p for p in (arg or "mtp_ce").split(",") if p]
    tiny = "tiny" in parts
    names = [p for p in parts if p != "tiny"]
    if len(names) != 1:
        raise ValueError(f"train_drafter: expected '<variant>[,tiny]', got {arg!r}")
    variant = names[0]

    c = default_config("drafter")
    c.seed = 0
    c.model.preset = "small"  # the frozen target's architecture (pretrain_target.py)
    c.data.kind = "embedded"
    c.data.seq_len = 128
    c.data.batch_size = 16
    c.data.eval_batches = 2
    c.train.num_steps = 300
    c.train.log_every = 10
    c.optimizer.learning_rate = 2e-3
    c.optimizer.warmup_steps = 20
    c.optimizer.weight_decay = 0.01
    c.optimizer.clip_norm = 1.0
    c.checkpoint.every = 100
    c.checkpoint.keep = 2

    t = c.task
    t.target_workdir = ""  # set on the command line (or by experiments/reproduce.py)
    t.mtp.shared = True
    t.mtp.intermediate_size = 256  # limited capacity (the target's MLP is 768)
    t.dspark.target_layers = "2,4"
    t.dspark.num_layers = 1
    t.dspark.rank = 64

    if variant.startswith("mtp_"):
        loss = variant[len("mtp_"):]
        ws = loss.endswith("_ws")
        loss = loss[:-3] if ws else loss
        if loss not in MTP_LOSSES:
            raise ValueError(f"train_drafter: unknown MTP loss {loss!r}; one of {MTP_LOSSES}")
        t.drafter = "mtp"
        t.gamma = 3
        t.loss = loss
        t.anchors_per_row = 32
        if ws:
            t.warm_start_loss = "ce"
            t.switch_step = c.train.num_steps // 2
    elif variant.split("_g")[0] in ("dspark_markov", "dspark_rnn", "dflash"):
        base, _, g = variant.partition("_g")
        t.drafter = "dflash" if base == "dflash" else "dspark"
        t.dspark.head = {"dspark_markov": "markov", "dspark_rnn": "rnn", "dflash": "none"}[base]
        t.dspark.confidence = base != "dflash"
        t.gamma = int(g) if g else 7
        t.loss = "dspark"
        t.anchors_per_row = 16
        # A short CPU budget: the first half with forward KL (dense gradients), then the DSpark
        # objective (whose L1 = 2·TV part learns slowly from a random init: gradient ∝ q).
        t.warm_start_loss = "kl"
        t.switch_step = c.train.num_steps // 2
    elif variant == "draft_lm":
        t.drafter = "draft_lm"
        t.gamma = 1  # its draft k at anchor i is its next-token distribution at i + k: γ-free
        t.loss = "kl"
        t.draft_lm.num_layers = 1
    else:
        raise ValueError(f"train_drafter: unknown variant {variant!r}")

    if tiny:
        c.model.preset = "tiny"
        c.model.overrides.vocab_size = 2048  # the tiny target of pretrain_target.py:tiny
        c.data.max_docs = 30
        c.data.seq_len = 32
        c.data.batch_size = 4
        c.data.eval_batches = 1
        c.train.num_steps = 4
        c.train.log_every = 2
        c.optimizer.warmup_steps = 1
        c.optimizer.learning_rate = 1e-2
        c.checkpoint.every = 2
        t.dspark.target_layers = "1,2"
        t.mtp.intermediate_size = 64
        t.anchors_per_row = min(t.anchors_per_row, 8)
        t.dspark.rank = 8
        if t.warm_start_loss:
            t.switch_step = 2
    return c
