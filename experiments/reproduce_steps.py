"""The reproduction driver's steps (:mod:`experiments.reproduce`): its sizes per mode
(:class:`Mode`, :data:`MODES`) and the runs it is built from, each skipped when its outputs
exist: the target (:func:`ensure_target`, cached by config and code), the token-row files
(:func:`ensure_data`), one drafter run (:func:`drafter_config`, :func:`train`), the Bebop
recipe for one MTP head (:func:`train_mtp`) and the DSpark-table run names."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

BEBOP_LOSSES = ("ce", "kl", "rkl", "tv", "e2e_tv")


@dataclasses.dataclass
class Mode:
    """Sizes of one reproduction mode (every field can be overridden from the command line)."""

    target_arg: str = ""  # pretrain_target.py:<arg>
    drafter_arg: str = ""  # train_drafter.py:<variant>,<arg>
    seq_len: int = 128
    batch_size: int = 16
    train_rows_per_domain: int = 3000
    max_docs: int = 0
    eval_rows: int = 48  # held-out rows per domain
    anchors: int = 8  # anchors per held-out row
    seeds: int = 3
    warm: int = 200  # CE warm-start steps (the head is well into training before TV takes over)
    fine: int = 100  # steps of each loss after the warm start (CE too: equal total budget)
    dspark_steps: int = 200
    draft_lm_steps: int = 200
    bebop_losses: tuple = BEBOP_LOSSES
    dspark_drafters: tuple = ("dflash", "dspark_markov", "dspark_rnn")
    dspark_gammas: tuple = (7, 15)
    lr: float = 2e-3
    mtp_grid: tuple = (("greedy", 0.0), ("rejection", 0.6), ("rejection", 1.0),
                       ("target_only", 0.6), ("target_only", 1.0))
    dspark_grid: tuple = (("rejection", 1.0),)
    dspark_eval_rows: int = 64  # more blocks for the DSpark table and the calibration (ECE noise)
    dspark_anchors: int = 16
    dspark_seeds: int = 3  # training seeds of every DSpark-table drafter (and calibration)
    # 1: when the Bebop part did not train them, train the CE MTP heads (warm + fine, one per
    # DSpark seed) for the table's recursive-MTP baseline; 0: use them only if they exist
    dspark_mtp: int = 1


MODES = {
    "full": Mode(),
    # about half the compute of "full": one seed, shorter runs, fewer held-out rows
    "reduced": Mode(seeds=1, warm=150, fine=75, dspark_steps=120, draft_lm_steps=120,
                    train_rows_per_domain=1500, eval_rows=32, dspark_eval_rows=48,
                    dspark_seeds=1, dspark_mtp=0),
    "tiny": Mode(target_arg="tiny", drafter_arg="tiny", seq_len=32, batch_size=4,
                 train_rows_per_domain=32, max_docs=30, eval_rows=6, anchors=4, seeds=1, warm=2,
                 fine=2, dspark_steps=2, draft_lm_steps=2, bebop_losses=("ce", "tv", "e2e_tv"),
                 dspark_eval_rows=6, dspark_anchors=4, dspark_seeds=1, dspark_mtp=0,
                 dspark_drafters=("dflash", "dspark_markov"), dspark_gammas=(7,), lr=1e-2),
}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def target_cache_dir(mode: Mode, config) -> str:
    """Where the target of ``config`` is cached: ``$SPECJAX_TARGET_CACHE`` (default
    ``~/.cache/specjax/targets``) ``/<mode>-<key>``, the key hashing the config and the code that
    trains it (:data:`specjax.code_version.TARGET_SOURCES`)."""
    from specjax.code_version import TARGET_SOURCES, artefact_key
    base = os.environ.get("SPECJAX_TARGET_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "specjax", "targets")
    return os.path.join(base, f"{mode.target_arg or 'full'}-"
                              f"{artefact_key(config.to_dict(), TARGET_SOURCES)}")


def ensure_target(mode: Mode, target_workdir: Optional[str], timings: dict) -> str:
    """A finished target workdir (pretraining it into the cache if needed)."""
    import importlib

    from specjax.training.checkpoint import Checkpointer
    if target_workdir is not None:  # given explicitly: reuse as is, never train in it
        ck = os.path.join(target_workdir, "checkpoints")
        c = Checkpointer(ck, async_save=False) if os.path.isdir(ck) else None
        step = c.latest_step() if c is not None else None
        if c is not None:
            c.close()
        if step is None or not os.path.exists(os.path.join(target_workdir, "config.json")):
            raise FileNotFoundError(f"--target_workdir {target_workdir}: no config.json / "
                                    f"complete checkpoint")
        _log(f"target: using {target_workdir} (step {step})")
        return target_workdir
    cfg_mod = importlib.import_module("experiments.configs.pretrain_target")
    config = cfg_mod.get_config(mode.target_arg or None)
    config.output.progress_bar = False
    if target_workdir is None:
        target_workdir = target_cache_dir(mode, config)
    ck = os.path.join(target_workdir, "checkpoints")
    done = False
    if os.path.isdir(ck):
        c = Checkpointer(ck, async_save=False)
        done = (c.latest_step() or 0) >= config.train.num_steps
        c.close()
    if done and os.path.exists(os.path.join(target_workdir, "config.json")):
        _log(f"target: reusing {target_workdir}")
        return target_workdir
    _log(f"target: pretraining {config.model.preset} for {config.train.num_steps} steps "
         f"-> {target_workdir}")
    t0 = time.perf_counter()
    from specjax.training.run import run, summary_lines
    result = run(config, target_workdir)
    timings["target_pretrain_s"] = time.perf_counter() - t0
    for line in summary_lines(result):
        _log("target" + line)
    return target_workdir


def target_config_of(target_workdir: str):
    from specjax.training.config import validate_config
    with open(os.path.join(target_workdir, "config.json")) as f:
        return validate_config(json.load(f))


def load_target_run(target_workdir: str):
    """``(model config, (graphdef, params), tokenizer)`` of a pretrained target's workdir: its
    last checkpoint and the tokenizer of the data it was trained on."""
    from specjax.data.tokenizer import load_tokenizer
    from specjax.training.drafter_task import load_target
    from specjax.training.lm_task import model_config_from
    from specjax.training.run import data_dir_of
    run_cfg = target_config_of(target_workdir)
    config = model_config_from(run_cfg)
    tok = load_tokenizer(os.path.join(data_dir_of(run_cfg, config.vocab_size), "tokenizer.json"))
    return config, load_target(config, target_workdir), tok


def ensure_data(mode: Mode, workdir: str, target_workdir: str, self_distill: Optional[float],
                timings: dict) -> tuple[str, str]:
    from specjax.data.tokenizer import load_tokenizer
    from specjax.training import drafter_data
    from specjax.training.lm_task import model_config_from
    from specjax.training.run import data_dir_of
    tcfg = target_config_of(target_workdir)
    data_dir = os.path.join(workdir, "data")
    os.makedirs(data_dir, exist_ok=True)
    train_path = os.path.join(data_dir, "train.npz" if self_distill is None
                              else f"train_selfdistill_T{self_distill:g}.npz")
    heldout_path = os.path.join(data_dir, "heldout.npz")
    if os.path.exists(train_path) and os.path.exists(heldout_path):
        return train_path, heldout_path
    t0 = time.perf_counter()
    tok = load_tokenizer(os.path.join(data_dir_of(tcfg, model_config_from(tcfg).vocab_size),
                                      "tokenizer.json"))
    max_docs = mode.max_docs or None
    train = drafter_data.build_token_rows(tok, split="train", seq_len=mode.seq_len,
                                          max_docs=max_docs, shuffle=True, seed=0,
                                          max_rows_per_domain=mode.train_rows_per_domain)
    heldout = drafter_data.build_token_rows(tok, split="heldout", seq_len=mode.seq_len,
                                            max_docs=max_docs)
    if self_distill is not None:
        from specjax.training.drafter_task import load_target
        from specjax.training.lm_task import model_config_from as mcf
        target = load_target(mcf(tcfg), target_workdir)
        _log(f"data: regenerating {len(train['tokens'])} training rows with the target at "
             f"T={self_distill}")
        train = drafter_data.regenerate_rows(target, train, prompt_len=mode.seq_len // 4,
                                             temperature=self_distill, eos_id=tok.eos_id,
                                             pad_id=tok.pad_id)
    drafter_data.save_rows(train_path, train)
    drafter_data.save_rows(heldout_path, heldout)
    timings["data_s"] = time.perf_counter() - t0
    _log(f"data: {len(train['tokens'])} train rows, {len(heldout['tokens'])} held-out rows "
         f"(T={mode.seq_len})")
    return train_path, heldout_path


def drafter_config(mode: Mode, variant: str, *, target_workdir: str, train_path: str,
                   heldout_path: str, steps: int, seed: int, init_from: str = ""):
    import importlib
    cfg_mod = importlib.import_module("experiments.configs.train_drafter")
    arg = variant + ("," + mode.drafter_arg if mode.drafter_arg else "")
    c = cfg_mod.get_config(arg)
    tcfg = target_config_of(target_workdir)
    c.model.preset = tcfg.model.preset
    for k, v in tcfg.model.overrides.items():
        c.model.overrides[k] = v
    c.seed = seed
    c.data.seed = seed
    c.data.seq_len = mode.seq_len
    c.data.batch_size = mode.batch_size
    c.train.num_steps = steps
    c.train.log_every = max(1, min(10, steps))
    c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, max(1, steps // 10))
    c.optimizer.learning_rate = mode.lr
    c.checkpoint.every = 0  # only at the end (resume granularity = one run)
    c.checkpoint.keep = 1
    c.output.progress_bar = False
    c.task.target_workdir = target_workdir
    c.task.data_file = train_path
    c.task.eval_file = heldout_path
    c.task.init_from = init_from
    if c.task.warm_start_loss:  # the config's schedule, rescaled to this run's length
        c.task.switch_step = max(1, steps // 2)
    return c


def train(name: str, config, workdir: str, timings: dict) -> str:
    """Trains one drafter run unless it is already finished; returns its workdir."""
    from specjax.training.checkpoint import Checkpointer
    from specjax.training.drafter_run import run_drafter
    wd = os.path.join(workdir, "drafters", name)
    ck = os.path.join(wd, "checkpoints")
    if os.path.isdir(ck):
        c = Checkpointer(ck, async_save=False)
        done = (c.latest_step() or 0) >= config.train.num_steps
        c.close()
        if done:
            _log(f"train {name}: done already")
            return wd
    t0 = time.perf_counter()
    result = run_drafter(config, wd)
    dt = time.perf_counter() - t0
    timings.setdefault("train_s", {})[name] = dt
    ev = result.eval
    accept = {d: round(m["accept_rate"], 3) for d, m in ev.items()}
    _log(f"train {name}: {config.train.num_steps} steps in {dt:.0f}s "
         f"(first step {result.trainer.first_step_seconds or 0:.0f}s); teacher-forced "
         f"accept_rate {accept}")
    return wd


def train_mtp(mode: Mode, loss: str, seed: int, common: dict, workdir: str,
              timings: dict) -> str:
    """The Bebop recipe for one MTP head: CE for ``mode.warm`` steps
    (``bebop_warm_ce_s<seed>``), then ``loss`` for ``mode.fine`` more from that checkpoint
    (``bebop_<loss>_s<seed>``). Returns the second workdir; finished runs are reused."""
    warm = train(f"bebop_warm_ce_s{seed}", drafter_config(
        mode, "mtp_ce", steps=mode.warm, seed=seed, **common), workdir, timings)
    return train(f"bebop_{loss}_s{seed}", drafter_config(
        mode, f"mtp_{loss}", steps=mode.fine, seed=seed, init_from=warm, **common),
        workdir, timings)


def variant_of(drafter: str, gamma: int) -> str:
    """``train_drafter.py`` variant of a DSpark-table drafter at ``gamma`` (7 or 15)."""
    return drafter + (f"_g{gamma}" if gamma != 7 else "")


def dspark_run_name(drafter: str, gamma: int) -> str:
    """Seed-0 run name of a DSpark-table drafter ("dspark_markov", 7 -> "dspark_markov_g7")."""
    return f"dspark_{drafter}_g{gamma}".replace("dspark_dspark_", "dspark_")
