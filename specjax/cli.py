"""``specjax`` command line: ``serve`` and ``eval``.

Both take a target (``--hf-dir`` HF checkpoint, ``--target-workdir`` specjax trainer workdir, or by
default the target a ``--drafter`` workdir was trained against), a drafter (``ngram``, or the
workdir of a drafter run of ``python -m experiments.train_drafter``: MTP, DSpark, DFlash, draft
LM), a scheduling ``--policy`` and a verification ``--method``. See :mod:`specjax.cli_load`.

``specjax serve``: runs the speculative engine over JSON-lines requests (stdin or ``--requests``)
and writes one JSON line per request (stdout or ``--out``). A request line is ``{"prompt": "text"}``
(needs a tokenizer) or ``{"prompt_ids": [..]}``, with optional ``max_new_tokens``,
``temperature``, ``top_k``, ``top_p``, ``stop`` (ids), ``seed``, ``id``. A bad line gets an
``"error"`` line (and exit status 1); the others are still served.

``specjax eval --prompts FILE.jsonl``: speculative vs plain decoding per prompt category; τ,
acceptance per draft position, tokens/s. See :mod:`specjax.cli_eval`.

Examples::

    # a trained DSpark drafter on the target it was trained against, the DSpark scheduler
    specjax serve --drafter runs/dspark_markov --policy dspark < reqs.jsonl
    # an HF checkpoint with the training-free n-gram drafter
    specjax serve --hf-dir ckpt/ --drafter ngram --policy fixed --gamma 4 < reqs.jsonl
    # Spec-Bench-style evaluation, JSON report
    specjax eval --drafter runs/mtp_e2e_tv --policy fixed --prompts question.jsonl --out eval.json
    # a random tiny model (smoke test)
    echo '{"prompt_ids": [1, 2, 3], "max_new_tokens": 8}' | specjax serve --preset tiny
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, TextIO

from specjax.cli_load import METHODS, SERVE_POLICIES, LoadError


def _parse_request(line: str, loaded, default_max: int):
    from specjax.cli_load import encode_prompt
    from specjax.engine import Request
    d = json.loads(line)
    if not isinstance(d, dict):
        raise ValueError("each request must be a JSON object")
    if "prompt_ids" in d:
        prompt = [int(t) for t in d["prompt_ids"]]
    elif "prompt" in d:
        prompt = encode_prompt(loaded, d["prompt"])
    else:
        raise ValueError("each request needs 'prompt' or 'prompt_ids'")
    return Request(prompt=prompt, max_new_tokens=int(d.get("max_new_tokens", default_max)),
                   stop_tokens=tuple(d.get("stop", ())),
                   temperature=float(d.get("temperature", 1.0)),
                   top_k=d.get("top_k"), top_p=d.get("top_p"), seed=int(d.get("seed", 0)),
                   request_id=d.get("id"))


def serve(args, loaded, engine, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    """Serves every request line; returns 1 if any line was bad, else 0."""
    src = open(args.requests) if args.requests else stdin
    out = open(args.out, "w") if args.out else stdout
    n_bad = 0
    ids = []
    for i, line in enumerate(src):
        if not line.strip():
            continue
        try:  # submit validates the request against the engine (ids, lengths, sampling)
            ids.append(engine.submit(_parse_request(line, loaded, args.max_new_tokens)))
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            n_bad += 1
            out.write(json.dumps({"line": i + 1, "finish_reason": "error", "error": str(e)}) + "\n")
    engine.run()
    for rid in ids:
        r = engine.finished.pop(rid)
        rec = {"id": rid, "tokens": r.tokens, "finish_reason": r.finish_reason,
               "ttft_s": r.ttft, "steps": r.steps, "accepted": r.accepted,
               "tau": (r.accepted + r.steps) / r.steps if r.steps else None}
        if r.error:
            rec["error"] = r.error
        if loaded.tokenizer is not None:
            rec["text"] = loaded.tokenizer.decode(r.tokens)
        out.write(json.dumps(rec) + "\n")
    out.flush()
    return 1 if n_bad else 0


def _add_model_flags(p: argparse.ArgumentParser, *, slots: int, temperature: bool) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--hf-dir", help="local HF checkpoint directory (Qwen3 / Llama safetensors)")
    src.add_argument("--target-workdir", help="specjax target trainer workdir (config.json + "
                     "checkpoints/); default: the target the --drafter was trained against")
    p.add_argument("--preset", default="tiny",
                   help="random-init target preset when no target and --drafter ngram (smoke)")
    p.add_argument("--drafter", default="ngram",
                   help="'ngram', or a drafter run's workdir (experiments.train_drafter)")
    p.add_argument("--policy", default="fixed", choices=SERVE_POLICIES,
                   help="verification-length policy; threshold / dspark / production need a "
                        "drafter with a confidence head (DSpark)")
    p.add_argument("--method", default="rejection", choices=METHODS)
    p.add_argument("--gamma", type=int, default=None, help="drafts per step (default: the "
                   "drafter's trained γ; 4 for ngram)")
    p.add_argument("--k", type=int, default=None, help="--policy fixed: drafts verified (≤ γ; "
                   "default γ)")
    p.add_argument("--threshold", type=float, default=0.5, help="--policy threshold")
    p.add_argument("--stale-decay", type=float, default=None,
                   help="--policy production: its stale confidences shrink towards the running "
                        "prior by this factor per step of age (1 = read as drafted; default: "
                        "SchedulerConfig's, see docs/SERVING.md)")
    p.add_argument("--tokenizer", help="tokenizer.json for text prompts (default: the target's)")
    p.add_argument("--prepend-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="start text prompts with EOS (default: on for specjax targets, whose "
                        "documents start with it; off for HF checkpoints)")
    p.add_argument("--slots", type=int, default=slots, help="requests decoded at once")
    p.add_argument("--max-len", type=int, default=512, help="cache positions per request")
    p.add_argument("--prefill-buckets", default="16,64,256",
                   help="compiled prompt chunk sizes (comma-separated; longer prompts are fed in "
                        "chunks of the largest)")
    p.add_argument("--token-buckets", default=None,
                   help="compiled verification batch sizes (comma-separated; default: powers of "
                        "two up to slots * (gamma + 1), which the largest must hold)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--loop", default="device", choices=("device", "host"),
                   help="device: many steps per jitted while-loop (fast); host: one step per "
                        "Python iteration (the reference)")
    p.add_argument("--loop-steps", type=int, default=16, help="--loop device: steps per call")
    p.add_argument("--row-buckets", default="auto",
                   help="--loop device: calls and admissions run on the active slots only, "
                        "padded to the smallest of these row counts (comma-separated, each below "
                        "--slots; 'auto': powers of two; 'none': every call runs every slot). "
                        "Each costs one more compiled loop at warm-up")
    p.add_argument("--online-calibration", action="store_true",
                   help="confidence policies (threshold, dspark, production) read the drafter's "
                        "confidences calibrated on the verifier's past decisions (--loop device)")
    p.add_argument("--sps-cache", help="JSON file caching the SPS profile (dspark / production)")
    p.add_argument("--profile-reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    if temperature:
        p.add_argument("--temperature", type=float, default=0.0)


def versions() -> str:
    """One line for bug reports: specjax's, jax's, jaxlib's and flax's versions and the JAX backend
    with its devices, and whether training logs an MFU there (the devices' peak in the chip
    tables; starting the backend, so only on request)."""
    from importlib import metadata

    import jax

    import specjax

    def dist(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    from specjax.training.train_loop import peak_flops

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    peak = peak_flops(devices)
    mfu = (f"MFU against {peak / len(devices) / 1e12:g} TFLOP/s bf16 per device" if peak else
           "no MFU: device not in specjax/aot/chips.py")
    return (f"specjax {specjax.__version__} (jax {jax.__version__}, jaxlib {dist('jaxlib')}, "
            f"flax {dist('flax')}; Python {sys.version.split()[0]}; backend "
            f"{jax.default_backend()}: {len(devices)} x {', '.join(kinds)}; {mfu})")


class _VersionAction(argparse.Action):
    """``--version``: computed when asked (``--help`` must not start a JAX backend)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the versions of specjax, jax, jaxlib and flax and the JAX "
                              "backend, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions())
        parser.exit()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specjax", description="specjax command line")
    ap.add_argument("--version", action=_VersionAction)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve JSON-lines requests with the speculative engine")
    _add_model_flags(s, slots=8, temperature=False)
    s.add_argument("--requests", help="JSON-lines file (default: stdin)")
    s.add_argument("--out", help="output file (default: stdout)")
    e = sub.add_parser("eval", help="speculative vs plain decoding per prompt category")
    _add_model_flags(e, slots=1, temperature=True)
    e.add_argument("--prompts", required=True,
                   help='JSON lines: {"category", "turns": [...]} (first turn used) or {"prompt"}')
    e.add_argument("--out", help="JSON report path")
    return ap


def main(argv: Optional[list] = None, stdin: TextIO = sys.stdin,
         stdout: TextIO = sys.stdout) -> int:
    args = parser().parse_args(argv)
    from specjax import cli_load
    try:
        loaded = cli_load.load(hf_dir=args.hf_dir, target_workdir=args.target_workdir,
                               preset=args.preset, drafter=args.drafter, tokenizer=args.tokenizer,
                               prepend_eos=args.prepend_eos, seed=args.seed)
        config = cli_load.engine_config(
            loaded, policy=args.policy, method=args.method, gamma=args.gamma, k=args.k,
            threshold=args.threshold, stale_decay=args.stale_decay, slots=args.slots,
            max_len=args.max_len, seed=args.seed,
            sps_cache=args.sps_cache, profile_reps=args.profile_reps,
            filters=args.command == "serve", prefill_buckets=args.prefill_buckets,
            token_buckets=args.token_buckets, loop=args.loop, loop_steps=args.loop_steps,
            online_calibration=args.online_calibration, row_buckets=args.row_buckets)
        if args.command == "eval":  # read the prompts before compiling anything
            from specjax import cli_eval
            cli_eval.read_prompts(args.prompts, loaded)
        engine = cli_load.make_engine(loaded, config)
        if args.command == "serve":
            return serve(args, loaded, engine, stdin, stdout)
        cli_eval.run(args, loaded, engine, stdout)
        return 0
    except (LoadError, FileNotFoundError) as e:
        print(f"specjax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
