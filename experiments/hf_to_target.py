r"""Convert a Hugging Face Qwen3 / Llama checkpoint into a specjax target workdir (run once).

The drafter task reads its frozen target from ``<workdir>/checkpoints`` (Orbax), restoring every
host's shards directly into the training mesh (``task.target_workdir``; see docs/TPU.md)::

    python -m experiments.hf_to_target --hf_dir /path/to/Qwen3-8B --preset qwen3-8b \
        --workdir /gcs/BUCKET/qwen3-8b-specjax

The checkpoint's architecture must equal the preset the drafter config names (checked here), and
parameters are stored in ``--dtype`` (bf16 by default, what ``tpu_pod.py`` configs read).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

# Fields that describe how the model is run, not its architecture.
_RUNTIME_FIELDS = ("dtype", "param_dtype", "max_position_embeddings")


def mismatches(a, b) -> list[str]:
    """Architecture fields that differ between two ModelConfigs."""
    return [f"{f.name}: {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
            for f in dataclasses.fields(a)
            if f.name not in _RUNTIME_FIELDS and getattr(a, f.name) != getattr(b, f.name)]


def convert(hf_dir: str, preset: str, workdir: str, dtype: str = "bfloat16") -> str:
    """Writes ``<workdir>/checkpoints/0`` from the HF checkpoint; returns the workdir.

    Raises:
      ValueError naming the fields where the checkpoint's architecture differs from ``preset``.
    """
    import os

    from flax import nnx

    from specjax.models import get_preset
    from specjax.models.hf_io import load_hf_checkpoint
    from specjax.training.checkpoint import Checkpointer

    config, state = load_hf_checkpoint(hf_dir, dtype=dtype)
    diff = mismatches(config, get_preset(preset))
    if diff:
        raise ValueError(f"{hf_dir} is not preset {preset!r}: " + "; ".join(diff))
    workdir = workdir if "://" in workdir else os.path.abspath(workdir)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=1, async_save=False)
    ckpt.save(0, {"params": nnx.to_pure_dict(state)}, {})
    ckpt.wait()
    ckpt.close()
    return workdir


def main(argv=None) -> None:
    # argparse, not absl flags: absl flags are process-global, and other entry points that tests
    # import into the same process define --workdir too.
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf_dir", required=True, help="Local HF checkpoint directory.")
    ap.add_argument("--preset", required=True, help="specjax preset it must match.")
    ap.add_argument("--workdir", required=True,
                    help="Output target workdir (a directory every training host sees).")
    ap.add_argument("--dtype", default="bfloat16", help="Parameter dtype stored.")
    args = ap.parse_args(argv)
    try:
        workdir = convert(args.hf_dir, args.preset, args.workdir, args.dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {workdir}/checkpoints/0 ({args.dtype})")


if __name__ == "__main__":
    main()
