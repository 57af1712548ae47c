"""Subprocess helper for the training tests (not collected: no ``test_`` prefix).

    python tests/_train_worker.py '<json spec>'

Spec keys:
  workdir (str | null)   trainer workdir (checkpoints, metrics); null = in-memory
  devices (int)          fake CPU devices of this process
  config (dict)          dotted overrides on top of a tiny synthetic-data config
  distributed (dict)     optional {"port", "num_processes", "process_id"} -> jax.distributed
  feed ("shard" | "concat:N")  this process's shard of the synthetic stream, or (single-process
                         reference) the concatenation of shards 0..N-1, row blocks in shard order
  kill_at (int)          SIGKILL this process right after the async save at that step started
  stop_after (int)       stop after that step without saving (a simulated crash)
  compile_cache (str)    persistent compilation cache dir shared by a test's workers (the
                         second and later workers skip recompiling the same step)
  out (str)              write params (assembled from this process's own shards) as .npz, and
                         their sha256 to out + ".sha256"
  reference (bool)       after training, train again from the same init in this same process and
                         mesh, but build each global batch from the *whole* concatenation of all
                         shards (``jax.make_array_from_callback``: every device takes its rows of
                         the global batch directly) instead of from this process's own shard.
                         Same program, same devices, same collectives, hence the same float
                         summation order: the params must agree bit for bit. Writes their sha256
                         to out + ".ref.sha256" (and the initial params' to ".init.sha256"), and checks every step that the batch the trainer
                         assembles from the shards equals the reference batch exactly.
"""
import hashlib
import json
import os
import signal
import sys

from _xla_flags import DEVICE_COUNT_FLAG, with_compile_speed_flags

spec = json.loads(sys.argv[1])
# The suite's compile-time settings (_xla_flags.py) and this process's own fake-device count. The
# bitwise comparisons these workers make are between programs compiled with the same flags.
os.environ["XLA_FLAGS"] = with_compile_speed_flags(
    f"--{DEVICE_COUNT_FLAG}={spec.get('devices', 1)}")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
if spec.get("compile_cache"):
    jax.config.update("jax_compilation_cache_dir", spec["compile_cache"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _train_common import ConcatIterator, base_config  # noqa: E402

from specjax.training import SyntheticLMIterator, Trainer  # noqa: E402
from specjax.training import distributed  # noqa: E402
from specjax.training import inputs as inputs_lib  # noqa: E402
from specjax.training import sharding as sharding_lib  # noqa: E402


def local_params(params):
    """Each array assembled from this process's addressable shards only (no communication)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        full = np.full(x.shape, np.nan, np.float32)
        for shard in x.addressable_shards:
            full[shard.index] = np.asarray(shard.data)
        assert not np.isnan(full).any(), f"{jax.tree_util.keystr(path)} not fully local"
        out[jax.tree_util.keystr(path)] = full
    return out


def digest_of(params):
    digest = hashlib.sha256()
    for k in sorted(params):
        digest.update(k.encode())
        digest.update(params[k].tobytes())
    return digest.hexdigest()


def reference_run(trainer, kw):
    """Params after ``num_steps`` from a fresh init, fed whole global batches (see ``reference``)."""
    cfg = trainer.config
    n = jax.process_count()
    whole = ConcatIterator(n, **kw)  # the global batch: shard 0's rows, then shard 1's, ...
    mine = SyntheticLMIterator(shard_index=jax.process_index(), num_shards=n, **kw)
    state = trainer.init_state()
    init_digest = digest_of(local_params(state.params))
    for step in range(cfg.train.num_steps):
        full = next(whole)
        arrays = {k: jax.make_array_from_callback(
            v.shape, sharding_lib.batch_sharding(trainer.mesh, v.ndim), lambda idx, v=v: v[idx])
            for k, v in full.items()}
        assembled = inputs_lib.global_batch(next(mine), trainer.mesh)  # what trainer.step feeds
        for k, a in arrays.items():
            for ref_shard, got_shard in zip(a.addressable_shards, assembled[k].addressable_shards):
                assert ref_shard.index == got_shard.index
                assert np.array_equal(np.asarray(ref_shard.data), np.asarray(got_shard.data)), \
                    f"step {step}: batch[{k!r}] rows {ref_shard.index} differ from the global batch"
        # The jitted step itself (Trainer.step = global_batch + this): same compiled program.
        state, _ = trainer._step(state, arrays, trainer.frozen)
    return state, init_digest


def main():
    config = base_config(spec.get("config", {}))
    if "distributed" in spec:
        d = spec["distributed"]
        config.distributed.coordinator_address = f"localhost:{d['port']}"
        config.distributed.num_processes = d["num_processes"]
        config.distributed.process_id = d["process_id"]
        assert distributed.maybe_initialize(config.distributed)
    trainer = Trainer(config, workdir=spec.get("workdir"))
    cfg = trainer.config
    n = jax.process_count()
    kw = dict(batch_size=cfg.data.batch_size // n, seq_len=cfg.data.seq_len,
              vocab_size=trainer.task.model_config.vocab_size, seed=cfg.data.seed)
    feed = spec.get("feed", "shard")
    if feed.startswith("concat:"):
        shards = int(feed.split(":")[1])
        kw["batch_size"] = cfg.data.batch_size // shards
        it = ConcatIterator(shards, **kw)
    else:
        it = SyntheticLMIterator(shard_index=jax.process_index(), num_shards=n, **kw)

    hooks = []
    if spec.get("kill_at"):
        def kill(_trainer, step, _state):
            if step == spec["kill_at"]:
                print(f"worker: SIGKILL at step {step} (async save in flight)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        hooks.append(kill)

    state = trainer.train(it, stop_after=spec.get("stop_after"), hooks=hooks)
    trainer.close()
    if spec.get("out"):
        params = local_params(state.params)
        np.savez(spec["out"], **params)
        with open(spec["out"] + ".sha256", "w") as f:
            f.write(digest_of(params))
    if spec.get("reference"):
        kw["batch_size"] = cfg.data.batch_size // n
        ref, init_digest = reference_run(trainer, kw)
        with open(spec["out"] + ".ref.sha256", "w") as f:
            f.write(digest_of(local_params(ref.params)))
        with open(spec["out"] + ".init.sha256", "w") as f:
            f.write(init_digest)
    print(f"worker: done at step {int(jax.device_get(state.step))}", flush=True)


if __name__ == "__main__":
    main()
