"""``specjax`` command line.

``specjax serve``: runs the speculative engine over JSON-lines requests (stdin or ``--requests``)
and writes one JSON line per finished request (stdout or ``--out``). A request line is
``{"prompt": "text"}`` (needs ``--tokenizer``) or ``{"prompt_ids": [..]}``, with optional
``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``stop`` (ids), ``seed``, ``id``.

Examples::

    # a local HF checkpoint (Qwen3 / Llama, safetensors) with the training-free n-gram drafter
    specjax serve --hf-dir /path/to/ckpt --tokenizer /path/to/ckpt/tokenizer.json < reqs.jsonl
    # a random tiny model (smoke test)
    echo '{"prompt_ids": [1, 2, 3], "max_new_tokens": 8}' | specjax serve --preset tiny
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, TextIO


def _load_target(args):
    if args.hf_dir:
        from specjax.models.hf_io import load_model
        return load_model(args.hf_dir)
    from specjax.models import get_preset, init_model
    return init_model(get_preset(args.preset), seed=args.seed)


def _parse_request(line: str, tokenizer, default_max: int):
    from specjax.engine import Request
    d = json.loads(line)
    if "prompt_ids" in d:
        prompt = [int(t) for t in d["prompt_ids"]]
    elif "prompt" in d:
        if tokenizer is None:
            raise ValueError("a text 'prompt' needs --tokenizer (or send 'prompt_ids')")
        prompt = tokenizer.encode(d["prompt"])
    else:
        raise ValueError("each request needs 'prompt' or 'prompt_ids'")
    return Request(prompt=prompt, max_new_tokens=int(d.get("max_new_tokens", default_max)),
                   stop_tokens=tuple(d.get("stop", ())), temperature=float(d.get("temperature", 1.0)),
                   top_k=d.get("top_k"), top_p=d.get("top_p"), seed=int(d.get("seed", 0)),
                   request_id=d.get("id"))


def serve(args, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    from specjax.drafters import NGramDrafter
    from specjax.engine import Engine, EngineConfig
    from specjax.scheduling import SchedulerConfig

    tokenizer = None
    if args.tokenizer:
        from specjax.data.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(args.tokenizer)
    target = _load_target(args)
    drafter = NGramDrafter(target.config.vocab_size)
    engine = Engine(target, drafter, None, None, EngineConfig(
        num_slots=args.slots, max_len=args.max_len, gamma=args.gamma,
        scheduler=SchedulerConfig("fixed", k=args.gamma)))
    engine.warmup(profile=False)
    src = open(args.requests) if args.requests else stdin
    out = open(args.out, "w") if args.out else stdout
    n_bad = 0
    ids = []
    for i, line in enumerate(src):
        if not line.strip():
            continue
        try:
            ids.append(engine.submit(_parse_request(line, tokenizer, args.max_new_tokens)))
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            n_bad += 1
            out.write(json.dumps({"line": i + 1, "finish_reason": "error", "error": str(e)}) + "\n")
    engine.run()
    for rid in ids:
        r = engine.finished.pop(rid)
        rec = {"id": rid, "tokens": r.tokens, "finish_reason": r.finish_reason,
               "ttft_s": r.ttft, "steps": r.steps, "accepted": r.accepted}
        if r.error:
            rec["error"] = r.error
        if tokenizer is not None:
            rec["text"] = tokenizer.decode(r.tokens)
        out.write(json.dumps(rec) + "\n")
    out.flush()
    return 1 if n_bad else 0


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="specjax", description="specjax command line")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve JSON-lines requests with the speculative engine")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--hf-dir", help="local HF checkpoint directory (Qwen3 / Llama safetensors)")
    src.add_argument("--preset", default="tiny", help="random-init model preset (smoke tests)")
    s.add_argument("--tokenizer", help="tokenizer.json for text prompts / outputs")
    s.add_argument("--requests", help="JSON-lines file (default: stdin)")
    s.add_argument("--out", help="output file (default: stdout)")
    s.add_argument("--slots", type=int, default=8)
    s.add_argument("--max-len", type=int, default=512)
    s.add_argument("--gamma", type=int, default=4)
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
