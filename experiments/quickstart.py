"""`make quickstart`: pretrain a target, train an MTP head with e2e-TV, measure the speed-up.

1. Pretrains the default target (``experiments/configs/pretrain_target.py``, preset "small") on the
   embedded math / code / prose corpus, or reuses the finished checkpoint cached under
   ``~/.cache/specjax/quickstart`` (``$SPECJAX_QUICKSTART_DIR`` overrides).
2. Prints held-out loss and perplexity per domain, a greedy continuation per domain and the share
   of held-out math problems the target solves by greedy decoding.
3. Trains an MTP head against the frozen target (``experiments/configs/train_drafter.py``, variant
   ``mtp_e2e_tv_ws``: CE for the first half of its steps, then the end-to-end TV loss of Bebop
   eq. 13), cached next to the target under a key of its config and code.
4. Decodes held-out math and code prompts one request at a time (B = 1) at T = 0 and T = 1 with
   the speculative engine (the MTP head, fixed K = γ, device loop) and with the fastest plain
   decoder of the same weights (the faster of ``generate(loop="device")`` and the engine's policy
   "none", same ``max_len``, measured in the same run, after a warm-up, median of 3 runs); prints
   the head's acceptance per draft position, τ, tokens/s and the speed-up.
5. Writes a one-page summary (``summary.md``, ``summary.png``, ``summary.json``) into the
   quickstart directory.

Run:
    make quickstart                      # or: .venv/bin/python -m experiments.quickstart
    .venv/bin/python -m experiments.quickstart --tiny    # smoke run: tiny model, a few steps
    .venv/bin/python -m experiments.quickstart --head-steps 300   # a longer-trained head

The workdirs of the target and of the head are printed (steps 1 and 3); ``benchmarks/spec_vs_plain.py``
takes them (``--target <target workdir> --drafter mtp=<head workdir>``) for the full grid of
batch sizes and domains.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time

import jax
import numpy as np

from specjax.data.corpus import DOMAINS, load_corpus
from specjax.data.math_problems import check_answer, extract_answer

HEAD_VARIANT = "mtp_e2e_tv_ws"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one quickstart mode runs (``FULL`` for ``make quickstart``, ``TINY`` for ``--tiny``)."""

    tiny: bool
    head_steps: int  # MTP head training steps (CE for the first half, then e2e-TV)
    prompts_per_domain: int  # held-out prompts per domain, decoded one at a time (B = 1)
    prompt_len: int  # prompt tokens (the first ones of a held-out document)
    new_tokens: int  # tokens generated per prompt
    reps: int  # timed runs per decoder and cell (after one warm-up run); the median is reported
    math_problems: int  # held-out math problems graded


FULL = Sizes(tiny=False, head_steps=100, prompts_per_domain=2, prompt_len=32, new_tokens=128,
             reps=3, math_problems=64)
TINY = Sizes(tiny=True, head_steps=4, prompts_per_domain=1, prompt_len=16, new_tokens=16, reps=1,
             math_problems=4)


def cache_base() -> str:
    """``$SPECJAX_QUICKSTART_DIR`` or ``~/.cache/specjax/quickstart``: targets, heads, summary."""
    return os.environ.get("SPECJAX_QUICKSTART_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "specjax", "quickstart")


def _workdir(tiny: bool) -> str:
    """The target's cache dir, keyed on its config and the code that trains it (a change to
    either trains a fresh target instead of reusing a stale one)."""
    from experiments.configs import pretrain_target
    from specjax.code_version import TARGET_SOURCES, artefact_key
    config = pretrain_target.get_config("tiny" if tiny else None)
    key = artefact_key(config.to_dict(), TARGET_SOURCES)
    return os.path.join(cache_base(), f"target_tiny-{key}" if tiny else f"target-{key}")


def cached_target(tiny: bool):
    """The quickstart's finished target workdir when it is cached, else None (notebooks reuse it
    instead of pretraining another copy)."""
    from experiments.configs import pretrain_target
    steps = pretrain_target.get_config("tiny" if tiny else None).train.num_steps
    return _workdir(tiny) if _finished(_workdir(tiny), steps) else None


def train_target(tiny: bool):
    """Trains (or resumes / reuses) the default target. Returns (RunResult, seconds)."""
    from experiments.configs import pretrain_target
    from specjax.training.run import run
    config = pretrain_target.get_config("tiny" if tiny else None)
    t0 = time.perf_counter()
    result = run(config, _workdir(tiny))
    return result, time.perf_counter() - t0


def head_config(sizes: Sizes, target_workdir: str):
    """The MTP head's training config: ``train_drafter.py:mtp_e2e_tv_ws[,tiny]`` against the
    given target, ``sizes.head_steps`` steps (CE for the first half, then e2e-TV)."""
    from experiments.configs import train_drafter
    c = train_drafter.get_config(HEAD_VARIANT + (",tiny" if sizes.tiny else ""))
    c.task.target_workdir = target_workdir
    c.train.num_steps = sizes.head_steps
    c.task.switch_step = max(1, sizes.head_steps // 2)
    c.train.log_every = max(1, min(10, sizes.head_steps))
    c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, max(1, sizes.head_steps // 10))
    c.checkpoint.every = 0  # only at the end
    c.checkpoint.keep = 1
    c.output.progress_bar = False
    return c


def head_workdir(config) -> str:
    """The head's cache dir next to its target, keyed on its config (the target by its own keyed
    directory name, so that moving the cache keeps the key) and the code that trains it."""
    from specjax.code_version import DRAFTER_SOURCES, artefact_key
    d = config.to_dict()
    target = os.path.basename(os.path.normpath(d["task"]["target_workdir"]))
    d["task"]["target_workdir"] = target
    key = artefact_key(d, DRAFTER_SOURCES)
    return os.path.join(os.path.dirname(os.path.normpath(config.task.target_workdir)),
                        f"{HEAD_VARIANT}-{key}")


def _finished(workdir: str, steps: int) -> bool:
    from specjax.training.checkpoint import Checkpointer
    ck = os.path.join(workdir, "checkpoints")
    if not (os.path.isdir(ck) and os.path.exists(os.path.join(workdir, "config.json"))):
        return False
    c = Checkpointer(ck, async_save=False)
    done = (c.latest_step() or 0) >= steps
    c.close()
    return done


def train_head(sizes: Sizes, target_workdir: str) -> tuple[str, float, bool]:
    """Trains the MTP head (or reuses the cached one). Returns (workdir, seconds, reused)."""
    from specjax.training.drafter_run import run_drafter
    config = head_config(sizes, target_workdir)
    wd = head_workdir(config)
    t0 = time.perf_counter()
    if _finished(wd, config.train.num_steps):
        return wd, time.perf_counter() - t0, True
    run_drafter(config, wd)
    return wd, time.perf_counter() - t0, False


def math_accuracy(model, tokenizer, n: int, max_new: int) -> tuple[float, int]:
    """Fraction of the first ``n`` held-out math problems answered correctly by greedy decoding."""
    from specjax.models.generate import generate
    docs = load_corpus("math", "heldout")[:n]
    prompts, answers = [], []
    for d in docs:
        prompt = d[:d.index("Answer:") + len("Answer:")]
        prompts.append([tokenizer.eos_id] + tokenizer.encode(prompt))
        answers.append(extract_answer(d))
    outs = generate(model, prompts, max_new, temperature=0.0, eos_id=tokenizer.eos_id)
    correct = sum(check_answer(a, tokenizer.decode(o)) for a, o in zip(answers, outs))
    return correct / max(1, len(docs)), len(docs)


def heldout_prompts(tok, domain: str, n: int, prompt_len: int) -> list[list[int]]:
    """The first ``prompt_len`` tokens (EOS first) of the first ``n`` held-out documents of
    ``domain`` that are longer than that."""
    out = []
    for d in load_corpus(domain, "heldout"):
        ids = tok.encode(d)
        if len(ids) >= prompt_len:
            out.append([tok.eos_id] + ids[:prompt_len - 1])
        if len(out) == n:
            return out
    raise ValueError(f"fewer than {n} held-out {domain} documents of {prompt_len} tokens")


def _median_time(fn, reps: int):
    """One warm-up call (compiles), then the median wall time of ``reps`` calls and the last
    call's output."""
    fn()
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def b1_max_len(prompt_len: int, new_tokens: int, gamma: int) -> int:
    """Cache length of the B = 1 comparison: prompt, new tokens and a draft, in blocks of 64."""
    return 64 * math.ceil((prompt_len + new_tokens + gamma + 2) / 64)


def b1_engine(target, drafter, params, frozen, *, max_len: int, policy: str, gamma: int):
    """A warmed-up one-slot engine (device loop) as the B = 1 comparison runs it: policy "none"
    (plain decoding) or "fixed" (K = ``gamma``)."""
    from specjax.engine import Engine, EngineConfig
    from specjax.scheduling import SchedulerConfig
    cfg = EngineConfig(num_slots=1, max_len=max_len, gamma=gamma, filters=False,
                       prefill_buckets=(64,), loop="device", loop_steps=64,
                       scheduler=SchedulerConfig(policy, k=gamma if policy == "fixed" else 0))
    eng = Engine(target, drafter, params, frozen, cfg)
    eng.warmup(profile=False)
    return eng


def speculative_vs_plain(model, head, tok, sizes: Sizes, *, domains=("math", "code"),
                         temperatures=(0.0, 1.0), log=print) -> dict:
    """Speculative engine (``head`` = ``(drafter, params, frozen, γ)``, fixed K = γ, device loop)
    against the fastest plain decoder, one request at a time (B = 1).

    Returns ``{"gamma", "max_len", "cells": [...]}``; each cell (domain, temperature) holds per
    decoder (``generate``, ``engine_none``, ``speculative``) the median ``wall_s`` over
    ``sizes.reps`` runs, ``tokens`` generated, ``requested`` tokens and ``tokens_per_s``; the
    speculative entry adds ``requests``, ``steps`` (request-steps), ``tau`` (tokens per
    request-step after each request's first token), ``drafted`` / ``accepted`` per draft
    position (summed over the last run's steps), ``reach`` (accepted / drafted: the share of
    steps whose drafts up to that position are all accepted) and ``alpha`` (acceptance at a
    position given the previous ones were accepted), and the cell its ``baseline`` (the faster
    plain decoder) and ``speedup``.
    """
    from flax import nnx

    from specjax.engine import Request
    from specjax.models.generate import generate_timed
    drafter, params, frozen, gamma = head
    max_len = b1_max_len(sizes.prompt_len, sizes.new_tokens, gamma)
    target = nnx.split(model)

    def engine(policy: str, g: int):
        return b1_engine(target, drafter, params, frozen, max_len=max_len, policy=policy, gamma=g)

    engines = {"engine_none": engine("none", 1), "speculative": engine("fixed", gamma)}
    cells = []
    for domain in domains:
        prompts = heldout_prompts(tok, domain, sizes.prompts_per_domain, sizes.prompt_len)
        requested = len(prompts) * sizes.new_tokens
        for temp in temperatures:
            dec = {}

            def plain():
                return [generate_timed(model, [p], sizes.new_tokens, temperature=temp,
                                       max_len=max_len, loop="device", seed=i).tokens[0]
                        for i, p in enumerate(prompts)]

            t, outs = _median_time(plain, sizes.reps)
            dec["generate"] = {"wall_s": t, "tokens": sum(map(len, outs))}
            for name, eng in engines.items():
                def served():
                    eng.loop_stats.clear()
                    return eng.generate([Request(prompt=p, max_new_tokens=sizes.new_tokens,
                                                 temperature=temp, seed=i)
                                         for i, p in enumerate(prompts)])

                t, res = _median_time(served, sizes.reps)
                entry = {"wall_s": t, "tokens": sum(len(r.tokens) for r in res)}
                if name == "speculative":
                    drafted = np.sum([s.drafted for s in eng.loop_stats], axis=0)
                    accepted = np.sum([s.accepted for s in eng.loop_stats], axis=0)
                    prev = np.concatenate([drafted[:1], accepted[:-1]])
                    steps = sum(r.steps for r in res)
                    entry.update(
                        requests=len(res), steps=steps,
                        tau=(entry["tokens"] - len(res)) / max(1, steps),
                        drafted=drafted.tolist(), accepted=accepted.tolist(),
                        reach=(accepted / np.maximum(drafted, 1)).tolist(),
                        alpha=(accepted / np.maximum(prev, 1)).tolist())
                dec[name] = entry
            for e in dec.values():
                e["requested"] = requested
                e["tokens_per_s"] = e["tokens"] / e["wall_s"]
            cell = {"domain": domain, "temperature": temp, "decoders": dec,
                    "baseline": max(("generate", "engine_none"),
                                    key=lambda n: dec[n]["tokens_per_s"])}
            cell["speedup"] = (dec["speculative"]["tokens_per_s"] /
                               dec[cell["baseline"]]["tokens_per_s"])
            cells.append(cell)
            log(cell_line(cell))
    return {"gamma": int(gamma), "max_len": max_len, "batch": 1, "reps": sizes.reps,
            "prompts_per_domain": sizes.prompts_per_domain, "new_tokens": sizes.new_tokens,
            "cells": cells}


def cell_line(cell: dict) -> str:
    dec = cell["decoders"]
    base, spec = dec[cell["baseline"]], dec["speculative"]
    return (f"  {cell['domain']:>5} T={cell['temperature']:.0f}: plain {base['tokens_per_s']:7.0f} "
            f"tokens/s ({cell['baseline']}), speculative {spec['tokens_per_s']:7.0f} tokens/s, "
            f"τ {spec['tau']:.2f}, speed-up {cell['speedup']:.2f}x")


def acceptance_lines(cells: list[dict]) -> list[str]:
    lines = []
    for c in cells:
        s = c["decoders"]["speculative"]
        lines.append(f"  {c['domain']:>5} T={c['temperature']:.0f}: α per position "
                     f"{' '.join(f'{a:.2f}' for a in s['alpha'])} | all accepted up to position "
                     f"{' '.join(f'{a:.2f}' for a in s['reach'])} | τ {s['tau']:.2f}")
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, a few steps (smoke run)")
    parser.add_argument("--head-steps", type=int, default=None,
                        help=f"MTP head training steps (default {FULL.head_steps}; "
                             f"--tiny: {TINY.head_steps}); a new value trains a new head")
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    if args.head_steps is not None:
        if args.head_steps < 2:
            parser.error("--head-steps must be >= 2 (CE for the first half, then e2e-TV)")
        sizes = dataclasses.replace(sizes, head_steps=args.head_steps)
    t_start = time.perf_counter()
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({len(jax.devices())} devices)")

    print("\n[1/5] target: pretrain on the embedded corpus (reused when cached)")
    result, train_s = train_target(sizes.tiny)
    from flax import nnx

    from experiments.offline_eval import load_trained
    from experiments.quickstart_report import write_summary
    from specjax.models import Transformer
    from specjax.models.generate import generate_timed
    from specjax.training.drafter_task import load_target
    from specjax.training.lm_task import model_config_from
    target_wd = _workdir(sizes.tiny)
    mcfg = model_config_from(result.trainer.config)
    graphdef, params = load_target(mcfg, target_wd)
    model = nnx.merge(graphdef, params)
    assert isinstance(model, Transformer)
    tok = result.tokenizer
    print(f"  {mcfg.num_params() / 1e6:.2f}M parameters ({mcfg.num_layers} layers, "
          f"d={mcfg.hidden_size}, vocab {mcfg.vocab_size}); {train_s:.0f} s (workdir {target_wd})")

    print("\n[2/5] held-out loss per domain, greedy continuations, math problems")
    for domain, m in sorted(result.eval.items()):
        print(f"  {domain:>6}: {m['ce']:.3f} nats/token, perplexity {math.exp(m['ce']):7.2f}, "
              f"next-token accuracy {m['accuracy']:.3f}")
    prompts = {d: [tok.eos_id] + tok.encode(load_corpus(d, "heldout")[0])[:24] for d in DOMAINS}
    out = generate_timed(model, list(prompts.values()), 48, temperature=0.0)
    for (domain, p), new in zip(prompts.items(), out.tokens):
        text = (tok.decode(p[1:]) + " ⟶ " + tok.decode(new)).replace("\n", "⏎")
        print(f"  {domain:>6}: {text[:160]}")
    acc, n = math_accuracy(model, tok, sizes.math_problems, 48)
    print(f"  held-out math solved by greedy decoding: {acc:.1%} of {n}")

    print(f"\n[3/5] MTP head ({HEAD_VARIANT}: CE, then e2e-TV; {sizes.head_steps} steps; "
          f"reused when cached)")
    head_wd, head_s, reused = train_head(sizes, target_wd)
    head = load_trained(head_wd, params)
    print(f"  γ = {head[3]}; {'reused' if reused else 'trained in'} {head_s:.0f} s "
          f"(workdir {head_wd})")

    print(f"\n[4/5] speculative engine (MTP head, K = γ = {head[3]}) vs the fastest plain decoder; "
          f"B = 1, {sizes.prompts_per_domain} held-out prompt(s) per domain, "
          f"{sizes.new_tokens} new tokens each, median of {sizes.reps}")
    comparison = speculative_vs_plain(model, head, tok, sizes)

    print("\n[5/5] acceptance of the MTP head in the engine (held-out prompts)")
    for line in acceptance_lines(comparison["cells"]):
        print(line)
    summary = {"tiny": sizes.tiny, "sizes": dataclasses.asdict(sizes),
               "backend": jax.default_backend(), "target_workdir": target_wd,
               "head_workdir": head_wd, "target_params": mcfg.num_params(),
               "target_train_s": train_s, "head_train_s": head_s, "head_reused": reused,
               "heldout": {d: dict(m) for d, m in result.eval.items()}, "math_solved": acc,
               **comparison}
    summary["total_s"] = time.perf_counter() - t_start
    paths = write_summary(summary, os.path.join(cache_base(),
                                                "summary_tiny" if sizes.tiny else "summary"))
    print(f"\nsummary: {paths['md']} (+ {os.path.basename(paths['png'])}, "
          f"{os.path.basename(paths['json'])})")
    print(f"quickstart finished in {summary['total_s']:.0f} s")
    return summary


if __name__ == "__main__":
    main()
