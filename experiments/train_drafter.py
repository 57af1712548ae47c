r"""Train a drafter against a frozen target: ``python -m experiments.train_drafter --config ... --workdir ...``.

Like ``experiments/train.py`` but for the ``"drafter"`` task: it builds the drafter's inputs
(token-row files or the embedded pipeline), stamps the loss schedule (CE warm start, then the
main loss) into the batches, and writes ``config.json``, ``metrics.jsonl``, ``loss_curve.png`` and
Orbax checkpoints (drafter params + optimizer + data position; re-running resumes). Configs:
``experiments/configs/train_drafter.py`` (its docstring has the commands).
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
        logging.set_verbosity(logging.WARNING)
    import jax

    from specjax.training.config import ConfigError
    from specjax.training.drafter_run import run_drafter

    try:
        result = run_drafter(_CONFIG.value, _WORKDIR.value)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if jax.process_index() == 0:
        t = result.trainer
        print(f"trained {int(result.state.step)} steps in {_WORKDIR.value} "
              f"(first step incl. compile: {t.first_step_seconds or 0:.1f}s)")
        for domain, m in sorted(result.eval.items()):
            alphas = " ".join(f"{m[k]:.3f}" for k in sorted(m) if k.startswith("alpha_"))
            print(f"  {domain:>10}: loss {m['loss']:.4f}  teacher-forced RS acceptance per "
                  f"position {alphas}  accept_rate {m['accept_rate']:.3f}")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
