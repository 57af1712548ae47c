"""`specjax serve`: JSON lines in, one JSON line per request out; bad lines reported, not dropped."""
import argparse
import io
import json

from specjax import cli
from specjax.models import get_preset, init_model
from specjax.models.generate import generate


def test_serve_jsonl_roundtrip():
    args = argparse.Namespace(hf_dir=None, preset="tiny", tokenizer=None, requests=None, out=None,
                              slots=2, max_len=48, gamma=3, max_new_tokens=5, seed=0)
    stdin = io.StringIO('{"prompt_ids": [1, 2, 3], "temperature": 0, "id": "a"}\n'
                        '\n{"prompt_ids": [7, 8], "max_new_tokens": 3, "seed": 4}\n'
                        '{"nothing": true}\n')
    stdout = io.StringIO()
    assert cli.serve(args, stdin, stdout) == 1  # one bad line
    lines = [json.loads(l) for l in stdout.getvalue().splitlines()]
    assert lines[0] == {"line": 4, "finish_reason": "error",
                        "error": "each request needs 'prompt' or 'prompt_ids'"}
    a, b = lines[1], lines[2]
    ref = generate(init_model(get_preset("tiny"), seed=0), [[1, 2, 3]], 5, temperature=0.0)[0]
    assert a["id"] == "a" and a["tokens"] == ref and a["finish_reason"] == "length"
    assert len(b["tokens"]) == 3
