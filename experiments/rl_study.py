r"""The RL study (docs/RL.md): pre-RL drafter adaptation, then GRPO arms with speculative rollouts.

    python -m experiments.rl_study --mode tiny  --workdir /tmp/specjax/rl_study_tiny
    python -m experiments.rl_study --mode small --workdir /tmp/specjax/rl_study_small
    python -m experiments.rl_study --mode full  --workdir runs/rl_study \
        --target_workdir runs/pretrain_target

1. **Pre-RL adaptation.** MTP heads (``experiments/configs/train_drafter.py`` ``mtp_<loss>``) trained
   with hard CE, KL (Bebop's soft CE), TV and e2e-TV on the policy's own samples (rows of
   prompt + policy completion at the sampling temperature), through
   :func:`specjax.training.drafter_run.run_drafter`; sweeps of γ, head capacity (MLP width) and
   temperature around a base cell. Held-out teacher-forced RS acceptance per cell.
2. **GRPO arms** (``experiments/rl_study_arms.py``): no speculation; TO + CE head; RS + CE head;
   RS + e2e-TV head (frozen); RS + e2e-TV head updated online with CE; ... with TV.
3. **Analysis** (``experiments/rl_study_report.py``): ``study.json`` and the figures.

Every finished cell / arm writes its own JSON; re-running skips them (resume per arm).
``--set arms=`` runs the adaptation alone; ``--set head_seed=1`` trains every head with another
seed (initialisation and order of the rows; the rows themselves stay the same), which is how the
spread of the adaptation gains between training seeds is measured.
tiny: a random tiny target, 2 RL steps, one seed (a smoke run: its numbers mean nothing).
"""
from __future__ import annotations

import json
import os
import sys
import time

ARMS = (
    {"name": "no_spec", "method": "none", "head": "ce", "online": None},
    {"name": "to_ce", "method": "target_only", "head": "ce", "online": None},
    {"name": "rs_ce", "method": "rejection", "head": "ce", "online": None},
    {"name": "rs_e2e_tv", "method": "rejection", "head": "e2e_tv", "online": None},
    {"name": "rs_e2e_tv_online_ce", "method": "rejection", "head": "e2e_tv", "online": "ce"},
    {"name": "rs_e2e_tv_online_tv", "method": "rejection", "head": "e2e_tv", "online": "tv"},
)
ARM_NAMES = tuple(a["name"] for a in ARMS)

MODES = {
    "tiny": dict(preset="tiny", warm_start=True, arms=ARM_NAMES,
                 losses=("ce", "kl", "tv", "e2e_tv"), gammas=(2,), caps=(64,),
                 temps=(1.0,), drafter_steps=2, drafter_batch=8, n_rows=8, rl_steps=2, seeds=(0,),
                 eval_every=1, n_train=32, n_heldout=4, prompts_per_step=2, num_generations=2,
                 max_new_tokens=8, max_prompt_length=96, num_slots=4, learning_rate=1e-3,
                 drafter_lr=1e-3, problem_seed=1234, head_seed=0, eval_samples=2),
    "small": dict(preset="tiny", warm_start=True, arms=ARM_NAMES,
                  losses=("ce", "kl", "tv", "e2e_tv"), gammas=(3, 5), caps=(64, 256),
                  temps=(0.6, 1.0), drafter_steps=100, drafter_batch=8, n_rows=128, rl_steps=20,
                  seeds=(0, 1, 2), eval_every=5, n_train=256, n_heldout=32, prompts_per_step=4,
                  num_generations=4, max_new_tokens=32, max_prompt_length=96, num_slots=16,
                  learning_rate=1e-4, drafter_lr=1e-4, problem_seed=1234, head_seed=0,
                  eval_samples=4),
    "full": dict(preset="small", warm_start=True, arms=ARM_NAMES,
                 losses=("ce", "kl", "tv", "e2e_tv"), gammas=(3, 5, 7),
                 caps=(128, 256, 768), temps=(0.6, 1.0, 1.2), drafter_steps=300, drafter_batch=16,
                 n_rows=1024, rl_steps=100, seeds=(0, 1, 2), eval_every=10, n_train=2000,
                 n_heldout=200, prompts_per_step=8, num_generations=4, max_new_tokens=64,
                 max_prompt_length=96, num_slots=32, learning_rate=1e-5, drafter_lr=1e-4,
                 problem_seed=1234, head_seed=0, eval_samples=4),
}


def parse_overrides(items) -> dict:
    """``["rl_steps=30", "seeds=0,1", "temps=1.0"]`` -> typed values for :data:`MODES` keys.

    A tuple-valued key takes a comma-separated list; every value is parsed with the type of the
    mode's default (so a typo in a key or a value is an error, not a silent default)."""
    ref, out = MODES["full"], {}
    for item in items or ():
        key, sep, raw = str(item).partition("=")
        key = key.strip()
        if not sep or key not in ref:
            raise ValueError(f"--set wants key=value with key in {sorted(ref)}, got {item!r}")
        default = ref[key]
        try:
            if key == "arms" and not raw.strip():
                out[key] = ()  # no arms: the pre-RL adaptation (and its gains) only
            elif isinstance(default, tuple):
                kind = type(default[0])
                out[key] = tuple(kind(v) for v in raw.split(",") if v.strip())
                if not out[key]:
                    raise ValueError("empty list")
            elif isinstance(default, bool):
                if raw.strip().lower() not in ("true", "false", "1", "0"):
                    raise ValueError("want true or false")
                out[key] = raw.strip().lower() in ("true", "1")
            else:
                out[key] = type(default)(raw)
        except ValueError as e:
            raise ValueError(f"--set {key}: cannot parse {raw!r} as {type(default).__name__}"
                             f" ({e})") from None
    return out


# Parameters that choose which finished results to use, not how they were produced: a workdir
# resumes with other values of these.
SELECTION_KEYS = ("arms", "seeds", "overrides")
# Parameters added after studies had been run, with the value those studies used: a workdir
# whose params.json predates a key resumes as if it had recorded this value.
LATER_KEYS = {"head_seed": 0, "eval_samples": 0}


def mode_params(mode: str, overrides: dict | None = None) -> dict:
    """The mode's parameters, with ``overrides`` (see :func:`parse_overrides`) applied."""
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {sorted(MODES)}, got {mode!r}")
    for key, value in (overrides or {}).items():
        if key not in MODES[mode]:
            raise ValueError(f"unknown study parameter {key!r}; choose from {sorted(MODES[mode])}")
        if isinstance(MODES[mode][key], tuple) and not isinstance(value, (tuple, list)):
            raise ValueError(f"study parameter {key!r} takes a tuple, got {value!r} "
                             f"(parse_overrides turns '{key}=a,b' into one)")
    p = dict(MODES[mode])
    p.update(overrides or {})
    p["mode"] = mode
    p["overrides"] = dict(overrides or {})
    p["temperature"] = 1.0 if 1.0 in p["temps"] else p["temps"][0]  # the RL sampling temperature
    p["gamma"], p["cap"] = p["gammas"][0], p["caps"][-1]  # the base cell (and the arms' γ)
    return p


def adaptation_cells(p: dict) -> list[dict]:
    """Every loss at the base cell, and one-factor sweeps of γ, capacity and temperature."""
    cells, seen = [], set()
    base = dict(gamma=p["gamma"], cap=p["cap"], temp=p["temperature"])
    for loss in p["losses"]:
        for key, vals in (("gamma", p["gammas"]), ("cap", p["caps"]), ("temp", p["temps"])):
            for v in vals:
                c = dict(base, loss=loss, **{key: v})
                name = f"{loss}_g{c['gamma']}_c{c['cap']}_t{c['temp']}"
                if name not in seen:
                    seen.add(name)
                    cells.append(dict(c, name=name))
    return cells


def build_policy(p: dict, target_workdir: str):
    """``(model, tokenizer, target_seed)``: the pretrained target, or a random ``preset`` model
    with a tokenizer trained on the math problems (as ``experiments/rl.py`` tiny)."""
    import ml_collections

    from experiments.rl import build_target
    c = ml_collections.ConfigDict(dict(target_workdir=target_workdir, preset=p["preset"], seed=0,
                                       data_dir=""))
    model, tok = build_target(c)
    return model, tok


def policy_rows(model, tok, problems, temperature: float, n: int, seq_len: int, seed: int):
    """Rows of ``[EOS] prompt completion`` with completions sampled from the policy."""
    import numpy as np

    from specjax.models.generate import generate
    probs = [problems[i % len(problems)] for i in range(n)]
    prompts = [[tok.eos_id] + tok.encode(q.prompt) for q in probs]
    gen = generate(model, prompts, seq_len - max(len(x) for x in prompts), temperature=temperature,
                   eos_id=tok.eos_id, seed=seed, max_len=seq_len)
    tokens = np.full((n, seq_len), tok.pad_id, np.int32)
    lengths = np.zeros(n, np.int32)
    for i, (pr, g) in enumerate(zip(prompts, gen)):
        s = (pr + list(g))[:seq_len]
        tokens[i, :len(s)], lengths[i] = s, len(s)
    return {"tokens": tokens, "lengths": lengths, "domain": np.zeros(n, np.int32),
            "domains": np.array(["math"])}


def _say(msg: str) -> None:
    """One progress line on stderr: an arm runs for minutes to an hour, and Tunix's step bar
    shows only on a terminal."""
    print(f"rl_study: {msg}", file=sys.stderr, flush=True)


def data_parallel_batch(batch: int, devices: int) -> int:
    """The smallest multiple of ``devices`` that is ≥ ``batch`` (rows split over every device)."""
    if batch < 1 or devices < 1:
        raise ValueError(f"batch and devices must be ≥ 1, got {batch}, {devices}")
    return -(-batch // devices) * devices


def run_adaptation(p, model, tok, target_workdir, workdir) -> list[dict]:
    import jax
    from experiments.configs import train_drafter
    from specjax.rl import task as T
    from specjax.training.drafter_data import save_rows
    from specjax.training.drafter_run import run_drafter

    train, heldout = T.split_problems(p["problem_seed"], p["n_train"], p["n_heldout"])
    seq_len = p["max_prompt_length"] + p["max_new_tokens"]
    # the drafter's batch is split over every device (data parallel): round it up to a multiple
    batch = data_parallel_batch(p["drafter_batch"], jax.device_count())
    if batch != p["drafter_batch"]:
        _say(f"drafter batch {p['drafter_batch']} -> {batch} (a multiple of the "
             f"{jax.device_count()} devices)")
    out = []
    cells = adaptation_cells(p)
    for i, cell in enumerate(cells):
        d = os.path.join(workdir, "adapt", cell["name"])
        done = os.path.join(d, "result.json")
        if os.path.exists(done):
            with open(done) as f:
                out.append(json.load(f))
            continue
        _say(f"adaptation {i + 1}/{len(cells)}: {cell['name']}, {p['drafter_steps']} drafter steps")
        files = {}
        for split, probs in (("train", train), ("eval", heldout)):
            path = os.path.join(workdir, "data", f"{split}_t{cell['temp']}.npz")
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                rows = policy_rows(model, tok, probs, cell["temp"],
                                   max(p["n_rows"], batch) if split == "train"
                                   else max(4, p["n_rows"] // 4),
                                   seq_len, seed=1 if split == "train" else 2)
                save_rows(path, rows)
            files[split] = path
        # Soft losses fine-tune a CE-trained head (CE for the first half of the budget), as
        # Bebop's pre-RL adaptation does: from a random init the TV losses learn slowly
        # (their gradient is proportional to q), which would compare initialisations, not losses.
        ws = "_ws" if p["warm_start"] and cell["loss"] != "ce" else ""
        c = train_drafter.get_config(f"mtp_{cell['loss']}{ws}"
                                     + (",tiny" if p["mode"] == "tiny" else ""))
        c.model.preset = p["preset"]
        c.model.overrides = {"vocab_size": model.config.vocab_size}
        c.task.target_workdir, c.task.target_seed = target_workdir, 0
        # a second training seed of the same cell: another init and another order of the rows
        c.seed += p["head_seed"]
        c.data.seed += p["head_seed"]
        c.task.data_file, c.task.eval_file = files["train"], files["eval"]
        c.task.gamma, c.task.mtp.intermediate_size = cell["gamma"], cell["cap"]
        c.task.target_temperature = cell["temp"]
        c.task.anchors_per_row = 16
        c.data.seq_len, c.data.batch_size, c.data.eval_batches = seq_len, batch, -1
        c.train.num_steps, c.checkpoint.every = p["drafter_steps"], p["drafter_steps"]
        if c.task.warm_start_loss:
            c.task.switch_step = max(1, p["drafter_steps"] // 2)
        c.train.log_every = max(1, p["drafter_steps"] // 4)
        t0 = time.perf_counter()
        res = run_drafter(c, d)
        ev = res.eval.get("math", next(iter(res.eval.values()), {}))
        r = dict(cell, seconds=time.perf_counter() - t0,
                 accept_rate=float(ev["accept_rate"]),
                 alpha=[float(ev[f"alpha_{k + 1}"]) for k in range(cell["gamma"])],
                 tv=float(ev["tv"]), ce=float(ev["ce"]))
        with open(done, "w") as f:
            json.dump(r, f, indent=1)
        _say(f"adaptation {cell['name']}: held-out acceptance {r['accept_rate']:.3f} "
             f"({r['seconds']:.0f} s)")
        out.append(r)
    return out


def adaptation_gains(workdir: str, adapt: list[dict]) -> dict:
    """Paired, row-clustered gains (points) of e2e-TV over KL and of KL over hard CE per cell
    (:mod:`experiments.rl_study_gains`); cached in ``<workdir>/gains.json``."""
    from experiments.rl_study_gains import paired_gains
    path = os.path.join(workdir, "gains.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    out = {"e2e_tv_vs_kl": paired_gains(workdir, adapt, "e2e_tv", "kl"),
           "kl_vs_ce": paired_gains(workdir, adapt, "kl", "ce")}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


def run_arms(p, model_factory, tok, adapt, workdir) -> list[dict]:
    from experiments.rl_study_arms import run_arm
    from specjax.training.drafter_run import load_drafter
    base = {c["loss"]: c for c in adapt if c["gamma"] == p["gamma"] and c["cap"] == p["cap"]
            and c["temp"] == p["temperature"]}
    out = []
    unknown = set(p["arms"]) - set(ARM_NAMES)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; choose from {ARM_NAMES}")
    runs = [(arm, seed) for arm in ARMS if arm["name"] in p["arms"] for seed in p["seeds"]]
    for i, (arm, seed) in enumerate(runs):
        d = os.path.join(workdir, "arms", f"{arm['name']}_s{seed}")
        if os.path.exists(os.path.join(d, "arm.json")):
            with open(os.path.join(d, "arm.json")) as f:
                out.append(json.load(f))
            continue
        # no_spec never drafts: any trained head fills the rollout's drafter slot
        head = arm["head"] if arm["method"] != "none" or arm["head"] in base else \
            next(iter(base), arm["head"])
        if head not in base:
            raise ValueError(f"arm {arm['name']} needs a {head!r} head at the base cell; "
                             f"add it to --set losses= (trained: {sorted(base)})")
        drafter, dparams, _ = load_drafter(os.path.join(workdir, "adapt", base[head]["name"]))
        _say(f"arm {i + 1}/{len(runs)}: {arm['name']} seed {seed}, {p['rl_steps']} GRPO steps")
        res = run_arm(arm, seed, p, model_factory(), tok, drafter, dparams, d)
        start = res["records"][0].get("heldout_accuracy") if res["records"] else None
        _say(f"arm {arm['name']} seed {seed}: held-out greedy accuracy "
             f"{'-' if start is None else f'{start:.3f}'} -> {res['heldout_accuracy_end']:.3f} "
             f"({res['train_seconds'] / 60:.1f} min of GRPO)")
        out.append(res)
    return out


def run_study(mode: str, workdir: str, target_workdir: str = "", results_dir: str = "",
              overrides: dict | None = None, name: str = "") -> dict:
    """Runs (or resumes) the study; writes ``study_<name>.json`` (``name`` defaults to the mode)
    and the figures into ``results_dir`` (default ``<workdir>/results``) and returns the summary.
    A workdir belongs to one set of parameters: resuming it with others is refused."""
    from experiments.rl_study_figures import write_figures
    from experiments.rl_study_report import study_markdown, summarize
    from specjax.evaluation import write_json
    p = mode_params(mode, overrides)
    name = name or mode
    if mode == "full" and not target_workdir:
        raise ValueError("--mode full needs --target_workdir (a pretrain_target.py workdir)")
    workdir = os.path.abspath(workdir)
    results_dir = results_dir or os.path.join(workdir, "results")
    _check_workdir_params(workdir, p)
    model, tok = build_policy(p, target_workdir)
    t0 = time.perf_counter()
    adapt = run_adaptation(p, model, tok, target_workdir, workdir)
    arms = run_arms(p, lambda: build_policy(p, target_workdir)[0], tok, adapt, workdir)
    summary = summarize(p, adapt, arms)
    summary["adaptation_paired_gains"] = adaptation_gains(workdir, adapt)
    summary["seconds"] = time.perf_counter() - t0
    os.makedirs(results_dir, exist_ok=True)
    # strict JSON: an undefined spread (one seed: nan) is written as null, which every parser
    # reads (NaN is a Python extension that jq and JavaScript refuse)
    write_json(os.path.join(results_dir, f"study_{name}.json"), summary)
    with open(os.path.join(results_dir, f"study_{name}.md"), "w") as f:
        f.write(study_markdown(summary))
    write_figures(summary, results_dir, name)
    return summary


def _check_workdir_params(workdir: str, p: dict) -> None:
    """Records the parameters in ``<workdir>/params.json``; a resume with other ones is an error
    (finished cells and arms would otherwise be mixed with new ones)."""
    path = os.path.join(workdir, "params.json")
    mine = json.loads(json.dumps(p))  # tuples -> lists, as stored
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        old = {k: v for k, v in {**LATER_KEYS, **old}.items() if k not in SELECTION_KEYS}
        if old != {k: v for k, v in mine.items() if k not in SELECTION_KEYS}:
            diff = sorted(k for k in set(old) | set(mine) if old.get(k) != mine.get(k))
            raise ValueError(f"{workdir} holds a study with other parameters ({', '.join(diff)});"
                             " use another --workdir")
        return
    os.makedirs(workdir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(mine, f, indent=1)


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="tiny", choices=sorted(MODES))
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--target_workdir", default="")
    ap.add_argument("--results_dir", default="", help="default <workdir>/results")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a mode parameter, e.g. --set rl_steps=30 --set seeds=0,1")
    ap.add_argument("--name", default="", help="results file suffix (default: the mode)")
    a = ap.parse_args(argv)
    try:
        overrides = parse_overrides(a.set)
    except ValueError as e:
        ap.error(str(e))
    s = run_study(a.mode, a.workdir, a.target_workdir, a.results_dir, overrides, a.name)
    print(json.dumps(s["claims"], indent=1), file=sys.stdout)


if __name__ == "__main__":
    main()
