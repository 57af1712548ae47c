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
* ``acceptance_per_position``: ``accepted_k / verified_k``, the fraction of verified k-th drafts
  that were accepted, from the engine's per-position counts ``verified_per_position`` /
  ``accepted_per_position`` (the definition of ``benchmarks/spec_vs_plain.py``). For k ≥ 2 a
  verified draft k also fails when an earlier draft of its step was rejected, so this is the
  survival of drafts 1..k, not the conditional ``α_k`` of :mod:`specjax.evaluation_stats`;
* ``conditional_acceptance_per_position``: ``α_k = P(draft k accepted | draft k verified and
  drafts 1..k-1 accepted)`` = ``accepted_k / reached_k`` (``reached`` counts come from the device
  loop's ``LoopStats`` or, one request per step, the host loop's; see :func:`position_counts`);
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
from specjax.paths import portable_path


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
    :func:`specjax.models.generate.generate_timed` (its device loop: the fastest plain decoder
    here) at a fixed cache length ``max_len``. Call it once before timing to compile its shapes.
    """
    from specjax.models.generate import generate_timed
    tokens, t0 = [], time.perf_counter()
    for s in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[s:s + batch]]
        tokens += generate_timed(model, chunk, max_new_tokens, temperature=temperature,
                                 seed=seed + s, max_len=max_len).tokens
    return tokens, time.perf_counter() - t0


def position_counts(loop_stats: Sequence, step_stats: Sequence, gamma: int) -> dict:
    """Per-position counts over the verification steps of one run, int ``[γ]`` each (or None).

    ``verified[k-1]``: request-steps that verified draft k; ``accepted[k-1]``: that accepted it;
    ``reached[k-1]``: that verified draft k with drafts 1..k-1 accepted.

    Sources: the device loop's :class:`~specjax.engine.LoopStats` (``drafted`` / ``accepted``
    per position, summed over slots; a ``reached`` field is used when the engine provides one),
    or the host loop's :class:`~specjax.engine.StepStats` (ℓ = ``drafts_verified`` and
    a = ``accepted``, which are one request's only in steps with one active request: with more,
    the counts are None).
    """
    out = {"verified": None, "accepted": None, "reached": None}
    if loop_stats:
        out["verified"] = np.sum([s.drafted for s in loop_stats], axis=0).astype(np.int64)
        out["accepted"] = np.sum([s.accepted for s in loop_stats], axis=0).astype(np.int64)
        if all(getattr(s, "reached", None) is not None for s in loop_stats):
            out["reached"] = np.sum([s.reached for s in loop_stats], axis=0).astype(np.int64)
        return out
    steps = [s for s in step_stats if s.active]
    if not steps or any(s.active > 1 for s in steps):
        return out
    ell = np.array([s.drafts_verified for s in steps], np.int64)[:, None]
    acc = np.array([s.accepted for s in steps], np.int64)[:, None]
    k = np.arange(1, gamma + 1)[None, :]
    out["verified"] = (ell >= k).sum(0)
    out["accepted"] = (acc >= k).sum(0)
    out["reached"] = ((ell >= k) & (acc >= k - 1)).sum(0)
    return out


def _ratio(num, den) -> Optional[list]:
    if num is None or den is None:
        return None
    return [float(a / r) if r else None for a, r in zip(num, den)]


def summarize(results, counts: dict, spec_s: float, plain_tokens, plain_s: float,
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
    out["acceptance_per_position"] = _ratio(counts["accepted"], counts["verified"])
    out["conditional_acceptance_per_position"] = _ratio(counts["accepted"], counts["reached"])
    for name in ("verified", "accepted", "reached"):
        c = counts[name]
        out[f"{name}_per_position"] = None if c is None else c.tolist()
    if temperature == 0:
        same = sum(list(r.tokens) == list(t) for r, t in zip(results, plain_tokens))
        out["greedy_agreement"] = same / len(results)
    return out


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(report: dict) -> str:
    """The per-category report as a fixed-width text table."""
    gamma = report["config"]["gamma"]
    head = (f"{'category':<16}{'n':>4}{'tau':>7}  "
            + " ".join(f"{'acc' + str(k):>5}" for k in range(1, gamma + 1))
            + f"{'spec tok/s':>12}{'plain tok/s':>13}{'speedup':>9}")
    lines = [head, "-" * len(head)]
    for cat, m in report["categories"].items():
        alpha = m["acceptance_per_position"] or [None] * gamma
        lines.append(f"{cat[:15]:<16}{m['prompts']:>4}{_fmt(m['tau']):>7}  "
                     + " ".join(f"{_fmt(a):>5}" for a in alpha)
                     + f"{_fmt(m['spec_tok_s'], '.1f'):>12}{_fmt(m['plain_tok_s'], '.1f'):>13}"
                     + f"{_fmt(m['speedup']):>8}x")
    lines.append("tau: tokens per verification step; acc_k: accepted / verified drafts at "
                 "position k; speedup: spec tok/s / plain tok/s")
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
    # compile every shape the timed runs use: the same calls (the decode loop's output buffer
    # has max_new_tokens columns, so a shorter warm-up would compile other shapes)
    for idx in cats.values():
        plain_decode(model, [ids[i] for i in idx], max_new_tokens, temperature=temperature,
                     seed=seed, max_len=cfg.max_len, batch=cfg.num_slots)
    report, pooled = {}, ([], [], [], 0.0, [], 0.0)
    for c, idx in cats.items():
        reqs = [Request(prompt=ids[i], max_new_tokens=max_new_tokens, temperature=temperature,
                        seed=seed + i) for i in idx]
        first_loop, first_step = len(engine.loop_stats), len(engine.stats)
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        spec_s = time.perf_counter() - t0
        loops, steps = engine.loop_stats[first_loop:], engine.stats[first_step:]
        plain, plain_s = plain_decode(model, [ids[i] for i in idx], max_new_tokens,
                                      temperature=temperature, seed=seed, max_len=cfg.max_len,
                                      batch=cfg.num_slots)
        report[c] = summarize(results, position_counts(loops, steps, cfg.gamma), spec_s, plain,
                              plain_s, temperature)
        pooled = (pooled[0] + results, pooled[1] + loops, pooled[2] + steps,
                  pooled[3] + spec_s, pooled[4] + plain, pooled[5] + plain_s)
        log(f"  {c}: {len(idx)} prompts, tau {_fmt(report[c]['tau'])}, "
            f"speedup {_fmt(report[c]['speedup'])}x")
    if len(cats) > 1:
        report["all"] = summarize(pooled[0], position_counts(pooled[1], pooled[2], cfg.gamma),
                                  *pooled[3:], temperature)
    return report


def run(args, loaded, engine, out_stream) -> dict:
    """``specjax eval``: reads ``args.prompts``, evaluates, writes ``args.out`` and the table."""
    prompts = read_prompts(args.prompts, loaded)
    report = {
        "config": {"drafter": loaded.drafter_name, "policy": args.policy, "method": args.method,
                   "gamma": engine.config.gamma, "slots": engine.config.num_slots,
                   "max_len": engine.config.max_len, "max_new_tokens": args.max_new_tokens,
                   "temperature": args.temperature, "seed": args.seed,
                   "prompts_file": portable_path(args.prompts),
                   "plain_decoder": "generate_timed (device loop)",
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
