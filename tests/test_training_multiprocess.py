"""Two processes on localhost (jax.distributed; CPU collectives are gloo, jax's default) with 2
fake CPU devices each train on one global 2 x 2 (data x fsdp) mesh while reading *different*
data shards. Both end with identical parameters (checksums over each process's own shards),
bit for bit equal to a run that feeds the whole concatenated global batch instead of per-process
shards, and the checkpoint they write holds both processes' iterator positions.

Why bitwise against a same-topology reference and not a tolerance against a single-process run:
a single process sums the 4 devices' partial gradients in another order than gloo's cross-process
all-reduce, so gradients differ by float32 rounding (|delta g| <= 3 * 2**-24 * sum|partials|).
AdamW turns that into a parameter change of up to 2 * learning rate per step on any entry whose
gradient is near zero (its update m / (sqrt(v) + eps) is then ~ sign(g), and a rounding error
can flip the sign), and global-norm clipping spreads the change to every entry. The only bound that
no summation order can break is therefore "2 * sum of the learning rates", i.e. as large as the
training signal itself: a tolerance that loose cannot see wrong data. Run in the same processes
on the same mesh, the reference compiles to the same program with the same collectives, so any
difference at all is a bug in how per-process shards become the global batch."""
import json
import os
import socket
import subprocess
import sys
import time

import orbax.checkpoint as ocp

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
                "out": str(tmp_path / f"p{pid}.npz"), "reference": True,
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
    for rc, out, err in _wait(procs, deadline):
        assert rc == 0, err[-4000:]
        assert "done at step 4" in out

    def sha(pid, kind=""):
        return open(tmp_path / f"p{pid}.npz{kind}.sha256").read()

    assert sha(0) == sha(1), "the two processes ended with different parameters"
    assert sha(0, ".ref") == sha(1, ".ref")
    assert sha(0) == sha(0, ".ref"), \
        "training on per-process shards differs from training on the whole global batch"
    assert sha(0) != sha(0, ".init"), "training left the parameters unchanged"

    # One checkpoint, written jointly, with each process's own iterator position.
    manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
    assert manager.all_steps() == [4]
    data = manager.restore(4, args=ocp.args.Composite(data=ocp.args.JsonRestore())).data
    assert data["processes"] == [{"step": 4, "shard_index": 0}, {"step": 4, "shard_index": 1}]
