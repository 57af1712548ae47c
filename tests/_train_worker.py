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
"""
import hashlib
import json
import os
import signal
import sys

spec = json.loads(sys.argv[1])
# LLVM -O0: halves the compile time of these tiny programs (XLA's HLO-level fusion, which
# decides the numerics, is unchanged).
os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={spec.get('devices', 1)} "
                           "--xla_backend_optimization_level=0")
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
        digest = hashlib.sha256()
        for k in sorted(params):
            digest.update(k.encode())
            digest.update(params[k].tobytes())
        np.savez(spec["out"], **params)
        with open(spec["out"] + ".sha256", "w") as f:
            f.write(digest.hexdigest())
    print(f"worker: done at step {int(jax.device_get(state.step))}", flush=True)


if __name__ == "__main__":
    main()
