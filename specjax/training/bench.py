"""Steps/s of the jitted train step (synthetic data, no checkpoints), for sizing runs.

    python -m specjax.training.bench --preset small --batch 8 --seq-len 256 --steps 8

Prints one JSON line: the first step (compile + run), then wall and process-CPU seconds per step
over ``--steps`` further steps. CPU seconds per step is the steadier number on a shared machine;
with the machine to itself, wall is roughly CPU / (cores used).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure(preset: str, batch: int, seq_len: int, steps: int, accum: int = 1) -> dict:
    import jax

    from specjax.training import SyntheticLMIterator, Trainer, default_config

    c = default_config()
    c.model.preset = preset
    c.data.seq_len, c.data.batch_size = seq_len, batch
    c.train.grad_accum_steps = accum
    c.checkpoint.every = -1
    trainer = Trainer(c)
    it = SyntheticLMIterator(batch_size=batch, seq_len=seq_len,
                             vocab_size=trainer.task.model_config.vocab_size)
    state = trainer.init_state()
    t0 = time.perf_counter()
    state, metrics = trainer.step(state, next(it))
    jax.block_until_ready(metrics)
    first = time.perf_counter() - t0
    c0, t0 = _cpu_seconds(), time.perf_counter()
    for _ in range(steps):
        state, metrics = trainer.step(state, next(it))
    jax.block_until_ready(metrics)
    wall = (time.perf_counter() - t0) / steps
    cpu = (_cpu_seconds() - c0) / steps
    return {"preset": preset, "batch": batch, "seq_len": seq_len, "devices": jax.device_count(),
            "first_step_s": round(first, 2), "wall_s_per_step": round(wall, 3),
            "cpu_s_per_step": round(cpu, 3), "steps_per_s": round(1 / wall, 3),
            "tokens_per_s": round(batch * seq_len / wall), "loadavg_1m": os.getloadavg()[0]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    a = p.parse_args(argv)
    print(json.dumps(measure(a.preset, a.batch, a.seq_len, a.steps, a.accum)))


if __name__ == "__main__":
    main()
