"""Train from an ml_collections config file.

    python -m experiments.train --config experiments/configs/pretrain_target.py --workdir DIR
    python -m experiments.train --config experiments/configs/pretrain_target.py:tiny --workdir DIR
    python -m experiments.train --config experiments/configs/pretrain_target.py \\
        --config.train.num_steps=100 --config.mesh.fsdp=2 --workdir DIR

``--config.<field>=value`` overrides any field (type-checked against the schema; a misspelt field
is an error). Re-running with the same ``--workdir`` resumes from its newest complete checkpoint.
Multi-host: start one process per host with ``--config.distributed.*`` (or the
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment variables);
see docs/TRAINING.md.
"""
from __future__ import annotations

import sys

from absl import app, flags, logging

from experiments.config_flag import define_config_flag

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics.jsonl, loss_curve.png.")


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    import jax

    from specjax.training.config import ConfigError
    from specjax.training.run import run, summary_lines
    from specjax.training.sharding import ShardingError

    try:
        result = run(_CONFIG.value, _WORKDIR.value)
    except (ConfigError, ShardingError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if jax.process_index() == 0:
        t = result.trainer
        print(f"trained {int(result.state.step)} steps in {_WORKDIR.value}: step loop "
              f"{t.train_seconds or 0:.1f}s (first step incl. compile "
              f"{t.first_step_seconds or 0:.1f}s), final eval {t.eval_seconds or 0:.1f}s")
        for line in summary_lines(result):
            print(line)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
