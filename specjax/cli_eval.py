"""``specjax eval``: speculative decoding against plain decoding on the same weights, per category.

Prompt file (JSON lines), one of per line:

* Spec-Bench style ``{"category": "...", "turns": ["first turn", ...]}``: only the **first turn** is
  used (multi-turn conversations would need the model's answers to the earlier turns, which a
  raw-text target does not have); the text is encoded as is, without a chat template;
* ``{"prompt": "text"}`` or ``{"prompt_ids": [..]}``, with an optional ``"category"`` (default
  ``"default"``).

Both decoders generate exactly ``max_new_tokens`` per prompt (no stop tokens), so they do the same
work. Per category (and pooled over all, ``"all"``) the report has:

* ``tau``: mean tokens emitted per verification step, ``(Σ accepted + Σ steps) / Σ steps`` over
  the requests (accepted drafts + the target's own token, per step);
* ``acceptance_per_position``: ``α_k = P(draft k accepted | drafts 1..k-1 accepted and draft k
  verified)``, with the counts ``reached`` / ``accepted`` it comes from. Computed from the engine's
  per-step statistics, which attribute a step to a request only when one request is active in it;
  with ``--slots > 1`` it is ``null`` (see :func:`position_counts`, the place to plug in
  per-request counts);
* ``spec_tok_s`` / ``plain_tok_s``: generated tokens per second of wall time (prefill included,
  compilation excluded: both decoders are warmed up first), and ``speedup`` = their ratio;
* ``greedy_agreement`` (temperature 0 only): fraction of prompts whose speculative output equals the
  plain one; speculative decoding is lossless, so anything below 1 means a near-tie in the
  target's logits decided differently under a different float summation order, or a bug.

The plain decoder is :func:`plain_decode` (one function, so a faster plain decoder drops in there).
It decodes the prompts in batches of ``--slots``, the engine's concurrency.
"""
from __future__ import annotations

import json
import time
from typing import Optional, Sequence

import numpy as np

from specjax.cli_load import LoadError, encode_prompt


def read_prompts(path: str, loaded) -> list[tuple[str, list[int]]]:
    """``[(category, token ids)]`` from a prompt file (see the module docstring)."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise LoadError(f"{path}:{i}: not JSON ({e})") from e
            if not isinstance(d, dict):
                raise LoadError(f"{path}:{i}: expected a JSON object")
            category = str(d.get("category", "default"))
            if "turns" in d:
                if not isinstance(d["turns"], list) or not d["turns"] or \
                        not isinstance(d["turns"][0], str):
                    raise LoadError(f"{path}:{i}: 'turns' must be a non-empty list of strings")
                ids = encode_prompt(loaded, d["turns"][0])
            elif "prompt" in d:
                ids = encode_prompt(loaded, str(d["prompt"]))
            elif "prompt_ids" in d:
                ids = [int(t) for t in d["prompt_ids"]]
            else:
                raise LoadError(f"{path}:{i}: each line needs 'turns', 'prompt' or 'prompt_ids'")
            if not ids:
                raise LoadError(f"{path}:{i}: empty prompt")
            out.append((category, ids))
    if not out:
        raise LoadError(f"{path}: no prompts")
    return out


def plain_decode(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature: float, seed: int, max_len: int, batch: int
                 ) -> tuple[list[list[int]], float]:
    """The plain-decoding baseline: ``(new tokens per prompt, wall seconds)``.

    Decodes ``prompts`` in consecutive batches of ``batch`` with
    :func:`specjax.models.generate.generate_timed` (the fastest plain decoder here) at a fixed cache
    length ``max_len``. Call it once before timing to compile its shapes.
    """
    from specjax.models.generate import generate_timed
    tokens, t0 = [], time.perf_counter()
    for s in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[s:s + batch]]
        tokens += generate_timed(model, chunk, max_new_tokens, temperature=temperature,
                                 seed=seed + s, max_len=max_len).tokens
    return tokens, time.perf_counter() - t0


def position_counts(stats: Sequence, gamma: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """``(reached [γ], accepted [γ])`` int counts over verification steps, or ``None``.

    ``reached[k-1]``: steps in which draft k was verified and drafts 1..k-1 were accepted;
    ``accepted[k-1]``: steps in which draft k was accepted. Derived from the engine's per-step
    :class:`~specjax.engine.StepStats` (``drafts_verified`` = ℓ, ``accepted`` = a), which is
    per-request only in steps with one active request; ``None`` when any step had more (the
    engine's results carry no per-position counts to use instead).
    """
    steps = [s for s in stats if s.active]
    if any(s.active > 1 for s in steps):
        return None
    ell = np.array([s.drafts_verified for s in steps], np.int64)
    acc = np.array([s.accepted for s in steps], np.int64)
    k = np.arange(1, gamma + 1)[None, :]
    reached = ((ell[:, None] >= k) & (acc[:, None] >= k - 1)).sum(0)
    accepted = (acc[:, None] >= k).sum(0)
    return reached, accepted


def summarize(results, stats, gamma: int, spec_s: float, plain_tokens, plain_s: float,
              temperature: float) -> dict:
    """One category's report entry (see the module docstring for the fields)."""
    steps = sum(r.steps for r in results)
    acc = sum(r.accepted for r in results)
    spec_n = sum(len(r.tokens) for r in results)
    plain_n = sum(len(t) for t in plain_tokens)
    out = {
        "prompts": len(results),
        "tokens": spec_n,
        "verify_steps": steps,
        "accepted_drafts": acc,
        "tau": (acc + steps) / steps if steps else None,
        "spec_tok_s": spec_n / spec_s if spec_s > 0 else None,
        "plain_tok_s": plain_n / plain_s if plain_s > 0 else None,
        "spec_s": spec_s,
        "plain_s": plain_s,
    }
    out["speedup"] = (out["spec_tok_s"] / out["plain_tok_s"]
                      if out["spec_tok_s"] and out["plain_tok_s"] else None)
    counts = position_counts(stats, gamma)
    if counts is None:
        out["acceptance_per_position"] = None
    else:
        reached, accepted = counts
        out["acceptance_per_position"] = [float(a / r) if r else None
                                          for a, r in zip(accepted, reached)]
        out["reached_per_position"] = reached.tolist()
        out["accepted_per_position"] = accepted.tolist()
    if temperature == 0:
        same = sum(list(r.tokens) == list(t) for r, t in zip(results, plain_tokens))
        out["greedy_agreement"] = same / len(results)
    return out


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(report: dict) -> str:
    """The per-category report as a fixed-width text table."""
    gamma = report["config"]["gamma"]
    head = (f"{'category':<16}{'n':>4}{'tau':>7}  " + " ".join(f"{'a' + str(k):>5}" for k in
                                                             range(1, gamma + 1))
            + f"{'spec tok/s':>12}{'plain tok/s':>13}{'speedup':>9}")
    lines = [head, "-" * len(head)]
    for cat, m in report["categories"].items():
        alpha = m["acceptance_per_position"] or [None] * gamma
        lines.append(f"{cat[:15]:<16}{m['prompts']:>4}{_fmt(m['tau']):>7}  "
                     + " ".join(f"{_fmt(a):>5}" for a in alpha)
                     + f"{_fmt(m['spec_tok_s'], '.1f'):>12}{_fmt(m['plain_tok_s'], '.1f'):>13}"
                     + f"{_fmt(m['speedup']):>8}x")
    return "\n".join(lines)


def evaluate(loaded, engine, prompts: list[tuple[str, list[int]]], *, max_new_tokens: int,
             temperature: float, seed: int, log=print) -> dict:
    """Runs both decoders on every category; returns the report (``config`` is the caller's)."""
    from specjax.engine import Request
    cfg = engine.config
    for i, (_, p) in enumerate(prompts):
        need = len(p) + max_new_tokens + cfg.gamma + 1
        if need > cfg.max_len:
            raise LoadError(f"prompt {i + 1} has {len(p)} tokens: prompt + max_new_tokens + gamma "
                            f"+ 1 = {need} exceeds --max-len {cfg.max_len}")
    model = loaded.model()
    cats: dict[str, list[int]] = {}
    for i, (c, _) in enumerate(prompts):
        cats.setdefault(c, []).append(i)
    ids = [p for _, p in prompts]
    # compile every shape the timed runs use (the same batches; generate_timed compiles its
    # decode step twice, at the first and the second step, so 3 new tokens)
    for idx in cats.values():
        plain_decode(model, [ids[i] for i in idx], min(3, max_new_tokens),
                     temperature=temperature, seed=seed, max_len=cfg.max_len,
                     batch=cfg.num_slots)
    report, pooled = {}, ([], [], 0.0, [], 0.0)
    for c, idx in cats.items():
        reqs = [Request(prompt=ids[i], max_new_tokens=max_new_tokens, temperature=temperature,
                        seed=seed + i) for i in idx]
        first = len(engine.stats)
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        spec_s = time.perf_counter() - t0
        stats = engine.stats[first:]
        plain, plain_s = plain_decode(model, [ids[i] for i in idx], max_new_tokens,
                                      temperature=temperature, seed=seed, max_len=cfg.max_len,
                                      batch=cfg.num_slots)
        report[c] = summarize(results, stats, cfg.gamma, spec_s, plain, plain_s, temperature)
        pooled = (pooled[0] + results, pooled[1] + list(stats), pooled[2] + spec_s,
                  pooled[3] + plain, pooled[4] + plain_s)
        log(f"  {c}: {len(idx)} prompts, tau {_fmt(report[c]['tau'])}, "
            f"speedup {_fmt(report[c]['speedup'])}x")
    if len(cats) > 1:
        report["all"] = summarize(pooled[0], pooled[1], cfg.gamma, pooled[2], pooled[3],
                                  pooled[4], temperature)
    return report


def run(args, loaded, engine, out_stream) -> dict:
    """``specjax eval``: reads ``args.prompts``, evaluates, writes ``args.out`` and the table."""
    prompts = read_prompts(args.prompts, loaded)
    report = {
        "config": {"drafter": loaded.drafter_name, "policy": args.policy, "method": args.method,
                   "gamma": engine.config.gamma, "slots": engine.config.num_slots,
                   "max_len": engine.config.max_len, "max_new_tokens": args.max_new_tokens,
                   "temperature": args.temperature, "seed": args.seed,
                   "prompts_file": args.prompts, "plain_decoder": "generate_timed",
                   "turns_used": "first"},
        "categories": evaluate(loaded, engine, prompts, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, seed=args.seed,
                               log=lambda s: print(s, file=out_stream)),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(table(report), file=out_stream)
    return report
