"""Two processes on localhost (jax.distributed; CPU collectives are gloo, jax's default) with 2
fake CPU devices each train on one global 2 x 2 (data x fsdp) mesh while reading *different*
data shards. Both end with identical parameters (checksums over each process's own shards),
equal to a single-process run on the concatenated global batches, and the checkpoint they write
holds both processes' iterator positions."""
import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from _train_common import ConcatIterator, base_config

from specjax.training import Trainer, make_mesh

WORKER = os.path.join(os.path.dirname(__file__), "_train_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {"mesh.data": 2, "mesh.fsdp": 2, "train.num_steps": 4, "checkpoint.every": 4}
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _spawn_pair(tmp_path, workdir):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = []
    for pid in range(2):
        spec = {"devices": 2, "config": OVERRIDES, "workdir": workdir,
                "out": str(tmp_path / f"p{pid}.npz"),
                "distributed": {"port": port, "num_processes": 2, "process_id": pid}}
        procs.append(subprocess.Popen([sys.executable, WORKER, json.dumps(spec)], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def _wait(procs, deadline):
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(deadline - time.time(), 1))
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:  # never leave a half of the pair waiting on its peer
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def test_two_processes_train_identically_on_different_shards(tmp_path):
    workdir = str(tmp_path / "mp")
    deadline = time.time() + TIMEOUT_S
    procs = _spawn_pair(tmp_path, workdir)

    # Meanwhile: the single-process reference on a 4-device sub-mesh of this process,
    # fed shard 0's rows then shard 1's (the global batch's row order on the 2-process mesh).
    config = base_config(OVERRIDES)
    config.checkpoint.every = -1
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 1}, devices=jax.devices()[:4])
    trainer = Trainer(config, mesh=mesh)
    it = ConcatIterator(2, batch_size=config.data.batch_size // 2, seq_len=config.data.seq_len,
                        vocab_size=trainer.task.model_config.vocab_size, seed=config.data.seed)
    ref = jax.device_get(trainer.train(it).params)

    for rc, out, err in _wait(procs, deadline):
        assert rc == 0, err[-4000:]
        assert "done at step 4" in out

    sha = [open(tmp_path / f"p{i}.npz.sha256").read() for i in range(2)]
    assert sha[0] == sha[1], "the two processes ended with different parameters"
    got = np.load(tmp_path / "p0.npz")
    flat_ref = {jax.tree_util.keystr(p): v
                for p, v in jax.tree_util.tree_flatten_with_path(ref)[0]}
    assert sorted(got.files) == sorted(flat_ref)
    for k, v in flat_ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)

    # One checkpoint, written jointly, with each process's own iterator position.
    manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
    assert manager.all_steps() == [4]
    data = manager.restore(4, args=ocp.args.Composite(data=ocp.args.JsonRestore())).data
    assert data["processes"] == [{"step": 4, "shard_index": 0}, {"step": 4, "shard_index": 1}]
