"""Drafter training for a real Qwen3 target on a TPU slice (the pod job of docs/TPU.md).

``arg`` = ``<target>,<drafter>[,<slice>[,<seq_len>]]``:

* ``<target>``: a model preset (``qwen3-0.6b``, ``qwen3-4b``, ``qwen3-8b``, ...), bf16 parameters;
* ``<drafter>``: ``mtp`` (one MTP head chained γ = 3, Bebop's e2e-TV loss) or ``dspark`` (one
  DSpark block with a Markov head and a confidence head, γ = 7, DSpark's loss);
* ``<slice>``: ``v5e-8`` | ``v5e-256`` | ``v5p-64`` | ``v6e-16`` | any slice or topology name
  (default ``v5p-64``). It sets the mesh (FSDP over the most chips that keep each chip's share of
  the hidden dimension whole TPU tiles, data parallel over the rest: :func:`fsdp_width`), the
  sequence length (4096, or
  shorter where a 4096-token row does not fit one chip: :data:`SHORTER_SEQ`) and the microbatch:
  every step trains on ``256 x 4096`` tokens (e.g. 1024 rows of 1024), in microbatches of one
  row per chip (gradient accumulation).
* ``<seq_len>``: overrides that sequence length (``python -m experiments.tpu_plan --table``
  starts every row at 4096 this way and halves until it fits).

Pre-flight (compile for the slice on any machine, see docs/TPU.md)::

    python -m experiments.tpu_plan --config experiments/configs/tpu_pod.py:qwen3-8b,mtp,v5p-64

Launch on every host of the slice (``jax.distributed`` finds the pod by itself; paths on a
directory every host mounts, e.g. a gcsfuse bucket)::

    python -m experiments.train_drafter \\
        --config experiments/configs/tpu_pod.py:qwen3-8b,mtp,v5p-64 \\
        --config.task.target_workdir /gcs/BUCKET/qwen3-8b-specjax \\
        --config.task.data_file /gcs/BUCKET/rows_4096.npz --workdir /gcs/BUCKET/runs/mtp-8b
"""
from specjax.aot.chips import chip_of, num_chips, whole_tiles_per_chip
from specjax.models import get_preset
from specjax.training.config import default_config
import specjax.training.drafter_task  # noqa: F401  (registers the "drafter" task)

TOKENS_PER_STEP = 256 * 4096  # global batch, whatever the sequence length
SEQ_LEN = 4096
# Sequence length per (slice, target, drafter) where a 4096-token row does not fit one chip in
# 90 % of HBM (v5e 16 GiB, v6e 32 GiB, v5p 95 GiB): the longest sequence that fits in
# experiments/results/tpu/table.json (docs/TPU.md; tests/test_pod_target.py checks that the two
# agree). Every v5p-64 and v6e-16 row fits at 4096. Another slice of a listed chip takes the
# shortest sequence listed for that chip, target and drafter. The table was compiled with
# train.attention_chunk = 0; with 512, two of these rows fit at 4096 (docs/TPU.md, "Memory").
TABLE_SLICES = ("v5p-64", "v6e-16", "v5e-8", "v5e-256")  # the slices of docs/TPU.md's table
SHORTER_SEQ = {
    ("v5e-8", "qwen3-8b", "mtp"): 2048, ("v5e-8", "qwen3-8b", "dspark"): 2048,
    ("v5e-8", "qwen3-4b", "dspark"): 2048,
    ("v5e-256", "qwen3-8b", "mtp"): 2048,
}
ROWS_PER_CHIP = 1  # microbatch rows per chip (more steps of gradient accumulation otherwise)


def fsdp_width(chips: int, hidden: int) -> int:
    """Chips to shard the parameters over (FSDP): the largest divisor ``f`` of ``chips`` that
    leaves each chip a whole number of bf16 tiles of the hidden dimension (``hidden / f`` a
    multiple of ``specjax.aot.chips.BF16_TILE_ROWS``, 16); ``chips`` when only ``f = 1`` would.

    Why: FSDP shards the weights on their hidden (``embed``) axis and gathers them for each use.
    Compiled for v5e-256, Qwen3-4B's 2560 hidden rows over 256 chips leave 10 per chip; the
    gathered LM head then lies as ``[256, 10, V]``, padded to ``[256, 16, V]`` in TPU's tiles, and
    is copied into ``[2560, V]`` for the matmul; four such copies were live at the step's peak.
    FSDP over 32 chips (80 rows each) and data parallelism over 8 cut the MTP step at 4096 tokens
    from 15.0 to 13.1 GiB per chip (docs/TPU.md, "FSDP width").
    """
    for f in sorted((d for d in range(2, chips + 1) if chips % d == 0), reverse=True):
        if whole_tiles_per_chip(hidden, f):
            return f
    return chips


def default_seq(slice_name: str, target: str, drafter: str) -> int:
    """The config's sequence length: for a slice of the docs/TPU.md table, :data:`SHORTER_SEQ` or
    4096; for another slice, the shortest listed for the same chip, target and drafter (e.g.
    ``v5e-16`` or ``v5e:4x4``), else 4096."""
    if slice_name in TABLE_SLICES:  # compiled: the table's answer
        return SHORTER_SEQ.get((slice_name, target, drafter), SEQ_LEN)
    chip = chip_of(slice_name).name
    same_chip = [v for (s, t, d), v in SHORTER_SEQ.items()
                 if chip_of(s).name == chip and t == target and d == drafter]
    return min(same_chip, default=SEQ_LEN)


def table_sequences(start: int = SEQ_LEN, floor: int = 512) -> list:
    """The sequence lengths ``tpu_plan --table`` tries for a row, longest first: ``start`` halved
    down to ``floor``. Each is this config at that sequence, so every try keeps the step's tokens
    (twice the rows at half the sequence), where ``tpu_plan --fit`` keeps the rows."""
    seqs = [start]
    while seqs[-1] // 2 >= floor:
        seqs.append(seqs[-1] // 2)
    return seqs


def get_config(arg: str | None = None):
    parts = [p for p in (arg or "qwen3-8b,mtp").split(",") if p]
    if len(parts) not in (2, 3, 4):
        raise ValueError(f"tpu_pod: expected '<target>,<drafter>[,<slice>[,<seq_len>]]', "
                         f"got {arg!r}")
    target, drafter = parts[:2]
    slice_name = parts[2] if len(parts) >= 3 else "v5p-64"
    chips = num_chips(slice_name)
    seq = default_seq(slice_name, target, drafter)
    if len(parts) == 4:
        if not parts[3].isdigit() or int(parts[3]) <= 0 or TOKENS_PER_STEP % int(parts[3]):
            raise ValueError(f"tpu_pod: seq_len must be a positive divisor of {TOKENS_PER_STEP}, "
                             f"got {parts[3]!r}")
        seq = int(parts[3])

    c = default_config("drafter")
    c.model.preset = target
    c.model.overrides.param_dtype = "bfloat16"  # the frozen target is served / read in bf16
    c.data.seq_len = seq
    c.data.batch_size = max(TOKENS_PER_STEP // seq, chips * ROWS_PER_CHIP)
    c.data.eval_batches = 0
    c.train.grad_accum_steps = max(1, c.data.batch_size // (chips * ROWS_PER_CHIP))
    c.train.num_steps = 20000
    c.train.log_every = 50
    c.optimizer.learning_rate = 3e-4
    c.optimizer.warmup_steps = 500
    c.optimizer.weight_decay = 0.01
    c.mesh.data = chips // fsdp_width(chips, get_preset(target).hidden_size)
    c.mesh.fsdp, c.mesh.tensor = -1, 1  # fsdp: the rest
    c.checkpoint.every = 1000
    c.checkpoint.keep = 3
    c.distributed.initialize = "always"  # TPU pods: jax.distributed finds its peers

    t = c.task
    if drafter == "mtp":
        t.drafter, t.loss, t.gamma = "mtp", "e2e_tv", 3
        t.mtp.num_heads = 1
        t.mtp.shared = True
        t.anchors_per_row = 256
    elif drafter == "dspark":
        t.drafter, t.loss, t.gamma = "dspark", "dspark", 7
        t.dspark.head = "markov"
        t.dspark.confidence = True
        t.dspark.num_layers = 1
        t.dspark.rank = 64
        layers = get_preset(target).num_layers  # context features from three depths
        t.dspark.target_layers = ",".join(str(x) for x in (layers // 4, layers // 2,
                                                            3 * layers // 4))
        t.anchors_per_row = 128
        t.position_weights = "exp"
    else:
        raise ValueError(f"tpu_pod: unknown drafter {drafter!r} (mtp | dspark)")
    return c
