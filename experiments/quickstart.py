"""`make quickstart`: the main job on the embedded default.

1. Pretrains the default target (``experiments/configs/pretrain_target.py``, preset "small") on the
   embedded math / code / prose corpus, or reuses the finished checkpoint cached under
   ``~/.cache/specjax/quickstart`` (``$SPECJAX_QUICKSTART_DIR`` overrides).
2. Prints held-out loss and perplexity per domain.
3. Samples a greedy continuation per domain with the KV cache (tokens/s) and grades held-out math
   problems answered by greedy decoding.
4. Serves a batch of held-out prompts with the speculative engine (training-free n-gram drafter,
   rejection sampling at temperature 1 and greedy) against plain decoding through the same engine.

Run:
    make quickstart                      # or: .venv/bin/python -m experiments.quickstart
    .venv/bin/python -m experiments.quickstart --tiny    # seconds: tiny model, few steps
"""
from __future__ import annotations

import argparse
import math
import os
import time

import jax
import numpy as np

from specjax.data.corpus import DOMAINS, load_corpus
from specjax.data.math_problems import check_answer, extract_answer


def _workdir(tiny: bool) -> str:
    """The target's cache dir, keyed on its config and the code that trains it (a change to
    either trains a fresh target instead of reusing a stale one)."""
    from experiments.configs import pretrain_target
    from specjax.code_version import TARGET_SOURCES, artefact_key
    config = pretrain_target.get_config("tiny" if tiny else None)
    base = os.environ.get("SPECJAX_QUICKSTART_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "specjax", "quickstart")
    key = artefact_key(config.to_dict(), TARGET_SOURCES)
    return os.path.join(base, f"target_tiny-{key}" if tiny else f"target-{key}")


def train_target(tiny: bool):
    """Trains (or resumes / reuses) the default target. Returns (RunResult, seconds)."""
    from experiments.configs import pretrain_target
    from specjax.training.run import run
    config = pretrain_target.get_config("tiny" if tiny else None)
    t0 = time.perf_counter()
    result = run(config, _workdir(tiny))
    return result, time.perf_counter() - t0


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


def engine_demo(model, tokenizer, *, slots: int, new_tokens: int, gamma: int = 4) -> list[str]:
    """Speculative engine (n-gram drafter) vs plain decoding through the same engine."""
    from flax import nnx

    from specjax.drafters import NGramDrafter
    from specjax.engine import Engine, EngineConfig, Request
    from specjax.scheduling import SchedulerConfig
    prompts = []
    for domain in DOMAINS:
        for d in load_corpus(domain, "heldout")[:slots]:
            prompts.append([tokenizer.eos_id] + tokenizer.encode(d)[:48])
    target = nnx.split(model)
    lines = []
    for temperature in (0.0, 1.0):
        rates = {}
        for policy in ("none", "fixed"):
            cfg = EngineConfig(num_slots=slots, max_len=48 + new_tokens + gamma + 2, gamma=gamma,
                               prefill_buckets=(64,), filters=False,
                               scheduler=SchedulerConfig(policy, k=gamma))
            engine = Engine(target, NGramDrafter(model.config.vocab_size), None, None, cfg)
            engine.warmup(profile=False)
            reqs = [Request(prompt=p, max_new_tokens=new_tokens, temperature=temperature, seed=i)
                    for i, p in enumerate(prompts)]
            t0 = time.perf_counter()
            res = engine.generate(reqs)
            dt = time.perf_counter() - t0
            toks = sum(len(r.tokens) for r in res)
            steps = sum(r.steps for r in res)
            rates[policy] = toks / dt
            lines.append(f"  T={temperature:.1f} {'plain decoding' if policy == 'none' else f'n-gram drafter, K={gamma}':>24}: "
                         f"{toks / dt:7.0f} tokens/s, {toks / max(1, steps):.2f} tokens per request-step")
        lines.append(f"  T={temperature:.1f} speed-up of speculation: {rates['fixed'] / rates['none']:.2f}x")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, a few steps (smoke run)")
    parser.add_argument("--math-problems", type=int, default=64)
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({len(jax.devices())} devices)")

    print("\n[1/4] target: pretrain on the embedded corpus (reused when cached)")
    result, train_s = train_target(args.tiny)
    from flax import nnx

    from specjax.models import Transformer
    from specjax.models.generate import generate_timed
    from specjax.training.drafter_task import load_target
    from specjax.training.lm_task import model_config_from
    mcfg = model_config_from(result.trainer.config)
    graphdef, params = load_target(mcfg, _workdir(args.tiny))
    model = nnx.merge(graphdef, params)
    assert isinstance(model, Transformer)
    tok = result.tokenizer
    print(f"  {mcfg.num_params() / 1e6:.2f}M parameters ({mcfg.num_layers} layers, "
          f"d={mcfg.hidden_size}, vocab {mcfg.vocab_size}); {train_s:.0f} s "
          f"(workdir {_workdir(args.tiny)})")

    print("\n[2/4] held-out loss per domain")
    for domain, m in sorted(result.eval.items()):
        print(f"  {domain:>6}: {m['ce']:.3f} nats/token, perplexity {math.exp(m['ce']):7.2f}, "
              f"next-token accuracy {m['accuracy']:.3f}")

    print("\n[3/4] greedy continuation per domain (KV cache)")
    prompts = {d: [tok.eos_id] + tok.encode(load_corpus(d, "heldout")[0])[:24] for d in DOMAINS}
    out = generate_timed(model, list(prompts.values()), 48, temperature=0.0)
    for (domain, p), new in zip(prompts.items(), out.tokens):
        text = (tok.decode(p[1:]) + " ⟶ " + tok.decode(new)).replace("\n", "⏎")
        print(f"  {domain:>6}: {text[:160]}")
    print(f"  decode: {out.decode_tokens_per_s:.0f} tokens/s (batch {len(prompts)})")
    acc, n = math_accuracy(model, tok, args.math_problems, 48)
    print(f"  held-out math solved by greedy decoding: {acc:.1%} of {n}")

    print("\n[4/4] speculative engine vs plain decoding (same engine, n-gram drafter)")
    for line in engine_demo(model, tok, slots=4, new_tokens=16 if args.tiny else 48):
        print(line)
    print(f"\nquickstart finished in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
