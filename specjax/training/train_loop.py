"""The host side of training: :meth:`Trainer.train`'s loop over steps.

It feeds :meth:`Trainer.step`, and around it logs (``metrics.jsonl`` / TensorBoard events, a
tqdm bar), evaluates every ``train.eval_every`` steps and at the end, saves checkpoints every
``checkpoint.every`` steps and at the end, calls the step hooks, and times the first step
(compilation) apart from the rest. Everything on the device is in ``trainer.py``.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np

from specjax.training import inputs as inputs_lib
from specjax.training import metrics as metrics_lib
from specjax.training.tasks import LOSS_WEIGHT

# trainer.py imports this module, so the Trainer / TrainState types are not imported back here.
Trainer = Any
TrainState = Any
# Called after every step (after any checkpoint save was started): hook(trainer, step, state).
StepHook = Callable[[Trainer, int, TrainState], None]


def train_loop(trainer: Trainer, train_iter: inputs_lib.BatchIterator,
               eval_batches: Optional[Mapping[str, Any]] = None, *,
               stop_after: Optional[int] = None,
               hooks: Sequence[StepHook] = ()) -> TrainState:
    """:meth:`Trainer.train` (see there): trains ``trainer`` to ``config.train.num_steps``."""
    from tqdm.auto import tqdm

    cfg = trainer.config
    num_steps = cfg.train.num_steps
    state = trainer.restore_or_init(train_iter)
    start = int(jax.device_get(state.step))
    writer = metrics_lib.MetricsWriter(
        os.path.join(trainer.workdir, "metrics.jsonl") if trainer.workdir else "",
        enabled=bool(trainer.workdir) and trainer.is_main,
        resume_step=start if start > 0 else None)
    bar = tqdm(total=num_steps, initial=start, desc="train", dynamic_ncols=True,
               disable=not (cfg.output.progress_bar and trainer.is_main))
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops_per_step = trainer.model_flops_per_step
    peak = peak_flops(trainer.mesh.devices.flat)
    pending: list[dict] = []
    last_time, last_step = time.perf_counter(), start
    step = saved = start
    loop_start = time.perf_counter()
    try:
        while step < num_steps:
            state, metrics = trainer.step(state, next(train_iter))
            step += 1
            pending.append(metrics)
            if step == start + 1:  # first step includes compilation: time it apart
                jax.block_until_ready(metrics)
                trainer.first_step_seconds = time.perf_counter() - last_time
                last_time, last_step = time.perf_counter(), step
            if step % cfg.train.log_every == 0 or step == num_steps:
                rates = None
                if step > last_step:
                    jax.block_until_ready(pending[-1])
                    now = time.perf_counter()
                    sps = (step - last_step) / (now - last_time)
                    rates = {"steps_per_sec": sps, "tokens_per_sec": sps * tokens_per_step}
                    if flops_per_step:
                        rates["model_tflops_per_sec"] = sps * flops_per_step / 1e12
                        if peak:
                            rates["mfu"] = sps * flops_per_step / peak
                    last_time, last_step = now, step
                summary = _summarise(pending)
                pending = []
                writer.write(step, "train", {**summary, **(rates or {})})
                bar.set_postfix(loss=f"{summary['loss']:.3f}", lr=f"{summary['lr']:.2e}")
            bar.update(1)
            if eval_batches and cfg.train.eval_every and step % cfg.train.eval_every == 0 \
                    and step != num_steps:
                _run_eval(trainer, state, eval_batches, step, writer)
            if _should_save(trainer, step):
                trainer.checkpointer.save(step, state, train_iter.get_state())
                saved = step
            for hook in hooks:
                hook(trainer, step, state)
            if stop_after is not None and step >= stop_after:
                return state
        jax.block_until_ready(state.step)
        trainer.train_seconds = time.perf_counter() - loop_start
        if eval_batches:  # (a finished run that is re-opened re-evaluates, logs nothing new)
            eval_start = time.perf_counter()
            _run_eval(trainer, state, eval_batches, step, writer if step > start else None)
            trainer.eval_seconds = time.perf_counter() - eval_start
        if trainer.checkpointer is not None and saved != step and step > start:
            trainer.checkpointer.save(step, state, train_iter.get_state())
    finally:
        bar.close()
        if trainer.checkpointer is not None:
            trainer.checkpointer.wait()
    if trainer.workdir and trainer.is_main and cfg.output.plot:
        metrics_lib.plot_loss_curve(writer.path, os.path.join(trainer.workdir, "loss_curve.png"))
    return state


def peak_flops(devices) -> Optional[float]:
    """Peak bf16 FLOP/s of ``devices`` together, from the chip tables of
    :mod:`specjax.aot.chips` (TPUs, one device per chip as a TPU VM's JAX shows them, and the
    NVIDIA GPUs of :data:`~specjax.aot.chips.GPUS`); ``None`` unless every device is listed (the
    MFU is then not logged)."""
    from specjax.aot.chips import chip_of_device_kind  # the package pulls in the AOT code
    chips = [chip_of_device_kind(d.device_kind) for d in devices]
    if not chips or None in chips:
        return None
    return float(sum(c.peak_bf16_flops for c in chips))


def _should_save(trainer, step: int) -> bool:
    every = trainer.config.checkpoint.every
    return trainer.checkpointer is not None and every > 0 and step % every == 0


def _run_eval(trainer, state, eval_batches, step, writer) -> None:
    trainer.last_eval = trainer.evaluate(state.params, eval_batches)
    for domain, values in trainer.last_eval.items():
        if writer is not None:
            writer.write(step, f"eval/{domain}", values)


def _summarise(pending: list[dict]) -> dict[str, float]:
    """Mean of each metric over the logged steps (``loss_weight`` summed as ``tokens``)."""
    fetched = jax.device_get(pending)
    out = {}
    for key in fetched[0]:
        vals = np.array([m[key] for m in fetched], np.float64)
        if key == LOSS_WEIGHT:
            out["tokens"] = float(vals.sum())
        elif key == "lr":
            out[key] = float(vals[-1])
        else:
            out[key] = float(vals.mean())
    return out
