"""Multi-host start-up: ``jax.distributed.initialize`` from the config or the environment.

Must run before anything touches a JAX backend (``jax.devices()``, any array). On CPU the
cross-process collectives are gloo over TCP (jax's default ``jax_cpu_collectives_implementation``),
so several local processes with fake CPU devices form one global mesh, as in the tests.

Sources, in order: ``config.distributed.{coordinator_address, num_processes, process_id}``, then
the environment (``JAX_COORDINATOR_ADDRESS`` is read by jax itself; ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` are this project's convention for the other two), then — with
``initialize="always"`` — jax's cluster auto-detection (TPU pods, SLURM, Kubernetes, ...).
"""
from __future__ import annotations

import os

import jax
import ml_collections


def maybe_initialize(dist: ml_collections.ConfigDict) -> bool:
    """Initialises ``jax.distributed`` when configured to; returns whether it did.

    Idempotent: a second call (or a call after the caller initialised it) does nothing.
    """
    if dist.initialize == "never":
        return False
    if jax.distributed.is_initialized():
        return True
    address = dist.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    num = dist.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", 0)) or None
    pid = dist.process_id if dist.process_id >= 0 else (
        int(os.environ["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in os.environ else None)
    if dist.initialize == "auto" and address is None and num is None:
        return False  # single process
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
    return True
