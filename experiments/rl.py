r"""GRPO with speculative rollouts: ``python -m experiments.rl --config ... --workdir ...``.

Tunix runs GRPO (``GRPOLearner`` over an ``RLCluster``); rollouts go through
:class:`specjax.rl.SpeculativeRollout` (the specjax engine with a frozen drafter, exact
verification); the learner trains :class:`specjax.rl.TunixPolicy` (the specjax target, one copy of
its weights). The reward is :mod:`specjax.rl.task`'s math correctness (+ optional format bonus).
Configs and commands: ``experiments/configs/rl_grpo.py``. Besides ``rollout.jsonl`` (one line of
rollout metrics per rollout), every reward function appends one line per training step to
``rewards.jsonl``; ``results.json`` holds the held-out evaluations, the reward trend and the
training rollouts' pooled exactness monitor (:func:`rollout_exactness`); with
``config.rl.speed_repeats`` > 0 also :func:`rollout_speed` of the final policy.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file with get_config(arg), optionally ':arg'.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, rollout.jsonl, results.json.")


def build_target(config):
    """``(Transformer, specjax Tokenizer)``: a trained target workdir, or (empty) a random
    ``config.preset`` model with a small tokenizer trained on the math problems."""
    from flax import nnx

    from specjax.data.math_problems import math_problems
    from specjax.data.tokenizer import load_tokenizer, train_tokenizer
    from specjax.models import get_preset, init_model
    if not config.target_workdir:
        tok = train_tokenizer([p.text for p in math_problems(config.seed, 400)], vocab_size=320)
        model = init_model(get_preset(config.preset, vocab_size=tok.vocab_size), seed=config.seed)
        return model, tok
    from specjax.training.config import validate_config
    from specjax.training.drafter_task import load_target
    from specjax.training.lm_task import model_config_from
    with open(os.path.join(config.target_workdir, "config.json")) as f:
        tcfg = validate_config(json.load(f))
    mcfg = model_config_from(tcfg)
    graphdef, params = load_target(mcfg, config.target_workdir)
    state = nnx.state(nnx.eval_shape(lambda: init_model(mcfg)))
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    data_dir = config.data_dir or tcfg.data.data_dir or os.environ.get("SPECJAX_DATA_DIR") or \
        os.path.join(os.path.expanduser("~"), ".cache", "specjax", "data",
                     f"vocab{mcfg.vocab_size}")
    return model, load_tokenizer(data_dir)


def build_drafter(config, model):
    """``(drafter, params, frozen)``; frozen "shared" = the policy's embedding / LM head."""
    from specjax.drafters import MTPConfig, MTPDrafter, NGramDrafter
    if config.drafter_workdir:
        from specjax.training.drafter_run import load_drafter
        drafter, params, _ = load_drafter(config.drafter_workdir)
        return drafter, params, "shared" if drafter.hidden_layers else None
    if config.drafter_kind == "mtp":
        d, p = MTPDrafter.create(model.config, MTPConfig(), seed=config.seed + 1)
        return d, p, "shared"
    if config.drafter_kind == "ngram":
        return NGramDrafter(model.config.vocab_size), None, None
    raise ValueError(f"drafter_kind must be 'mtp' or 'ngram', got {config.drafter_kind!r}")


def run(config, workdir: str) -> dict:
    """Builds the target, drafter, task and Tunix cluster; trains; returns (and writes) results."""
    import jax
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx
    from specjax.rl import require_tunix
    require_tunix()  # before Tunix's imports: an error that names the extra
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
    from tunix.rl.rollout.base_rollout import RolloutConfig
    from tunix.sft.metrics_logger import MetricsLoggerOptions

    from specjax.engine import EngineConfig
    from specjax.engine.requests import parse_row_buckets
    from specjax.rl import SpeculativeRollout, TunixPolicy
    from specjax.rl import task as T
    from specjax.buckets import prompt_chunk_buckets
    from specjax.scheduling import SchedulerConfig

    if config.task.reward not in ("math", "digits"):
        raise ValueError(f"config.task.reward must be 'math' or 'digits', got "
                         f"{config.task.reward!r}")

    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    model, tok = build_target(config)
    drafter, dparams, frozen = build_drafter(config, model)
    train, heldout = T.split_problems(config.task.problem_seed, config.task.n_train,
                                      config.task.n_heldout)
    ttok = T.TunixTokenizer(tok)
    r, e = config.rl, config.engine
    max_len = r.max_prompt_length + max(r.max_new_tokens, r.eval_max_new_tokens) + e.gamma + 2
    engine_config = EngineConfig(
        num_slots=e.num_slots, max_len=max_len, gamma=e.gamma, method=e.method,
        prefill_buckets=tuple(e.prefill_buckets) or
        prompt_chunk_buckets(r.max_prompt_length),
        scheduler=SchedulerConfig("fixed", k=e.gamma), overlap=e.overlap,
        filters=r.top_p < 1.0,  # no top-p: no sort over the vocabulary compiled into the loop
        row_buckets=parse_row_buckets(e.get("row_buckets", "none")))
    rollout_config = RolloutConfig(
        max_tokens_to_generate=r.max_new_tokens, max_prompt_length=r.max_prompt_length,
        temperature=r.temperature, top_p=r.top_p, eos_tokens=[ttok.eos_id()], seed=config.seed)
    n_dev = len(jax.devices())
    mesh = jax.make_mesh((n_dev, 1), ("fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    training_config = rl.RLTrainingConfig(
        actor_optimizer=optax.adamw(r.learning_rate), eval_every_n_steps=10 ** 9,
        max_steps=r.steps, checkpoint_root_directory=os.path.join(workdir, "checkpoints"),
        checkpointing_options=ocp.CheckpointManagerOptions(
            save_interval_steps=r.checkpoint_every, max_to_keep=2),
        metrics_logging_options=MetricsLoggerOptions(
            log_dir=os.path.join(workdir, "tensorboard"), flush_every_n_steps=1))
    rollout_engine = functools.partial(
        SpeculativeRollout, drafter=drafter, drafter_params=dparams, frozen=frozen,
        engine_config=engine_config, seed=config.seed,
        metrics_jsonl=os.path.join(workdir, "rollout.jsonl"))
    cluster = rl.RLCluster(
        actor=TunixPolicy(model), reference=TunixPolicy(model) if r.beta else None,
        tokenizer=ttok, cluster_config=rl.ClusterConfig(
            role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
            rollout_engine=rollout_engine, offload_to_cpu=False,
            training_config=training_config, rollout_config=rollout_config))
    rollout = cluster.rollout.attach(cluster)

    def correct(prompts, completions, answer, **kw):
        if config.task.reward == "digits":
            return T.digit_reward(prompts, completions)
        return T.correctness_reward(prompts, completions, answer)

    def fmt(prompts, completions, **kw):
        return T.format_reward(prompts, completions, weight=config.task.format_reward)

    calls = {}

    def logged(fn):
        """``fn`` that appends ``{"step", "reward", "mean", "n"}`` to rewards.jsonl per call (once
        per training step: no evaluation rollouts go through the learner)."""
        @functools.wraps(fn)  # Tunix names its reward metrics after the function
        def wrapped(prompts, completions, **kw):
            r = fn(prompts, completions, **kw)
            step = start_step + calls.get(fn.__name__, 0)
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            with open(os.path.join(workdir, "rewards.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "reward": fn.__name__,
                                    "mean": float(sum(r)) / max(1, len(r)), "n": len(r)}) + "\n")
            return r
        return wrapped

    rewards = [logged(correct)] + ([logged(fmt)] if config.task.format_reward else [])
    learner = GRPOLearner(rl_cluster=cluster, reward_fns=rewards, algo_config=GRPOConfig(
        num_generations=r.num_generations, num_iterations=1, beta=r.beta, epsilon=r.epsilon))
    start_step = int(cluster.actor_trainer.restored_global_step())
    # the rollout engine must serve the (possibly restored) policy before evaluating it
    rollout.update_params(nnx.state(rollout.model(), nnx.Param))
    eval_rc = RolloutConfig(max_tokens_to_generate=r.eval_max_new_tokens,
                            max_prompt_length=r.max_prompt_length, temperature=0.0,
                            eos_tokens=[ttok.eos_id()])

    # the held-out reward GRPO maximises: eval_samples completions per problem at the RL
    # temperature (its own seed), beside greedy accuracy
    sampled_rc = RolloutConfig(max_tokens_to_generate=r.eval_max_new_tokens,
                               max_prompt_length=r.max_prompt_length, temperature=r.temperature,
                               top_p=r.top_p, eos_tokens=[ttok.eos_id()],
                               seed=config.seed + T.EVAL_SEED_OFFSET)

    def heldout_eval():
        with mesh:  # the context Tunix runs rollouts in (jit caches are keyed on it)
            return T.heldout_eval(functools.partial(rollout.generate, mode="eval"), heldout,
                                  eval_rc, sampled_rc, r.eval_samples)

    ev0 = heldout_eval()
    t0 = time.perf_counter()
    learner.train(T.batches(train, r.prompts_per_step, config.seed, r.steps))
    train_s = time.perf_counter() - t0
    rollout.update_params(nnx.state(rollout.model(), nnx.Param))
    ev1 = heldout_eval()
    results = {"start_step": start_step, "end_step": int(cluster.global_steps),
               "heldout_accuracy_start": ev0["heldout_accuracy"],
               "heldout_accuracy_end": ev1["heldout_accuracy"],
               "heldout_greedy_gain": T.paired_gain(ev0["heldout_correct"],
                                                    ev1["heldout_correct"]),
               "n_heldout": len(heldout), "train_seconds": train_s,
               "devices": n_dev, "method": e.method, "gamma": e.gamma}
    if r.eval_samples:
        results.update(
            eval_samples=r.eval_samples,
            heldout_sampled_accuracy_start=ev0["heldout_sampled_accuracy"],
            heldout_sampled_accuracy_end=ev1["heldout_sampled_accuracy"],
            heldout_sampled_gain=T.paired_gain(ev0["heldout_sampled_per_problem"],
                                               ev1["heldout_sampled_per_problem"]))
    if r.speed_repeats:
        batch = next(iter(T.batches(train, r.prompts_per_step, config.seed + 1, 1)))
        prompts = [str(q) for q in batch["prompts"] for _ in range(r.num_generations)]
        with mesh:
            results["rollout_speed"] = rollout_speed(rollout, prompts, rollout_config,
                                                     r.speed_repeats)
    results["reward_trend"] = reward_trend(os.path.join(workdir, "rewards.jsonl"))
    results["exactness"] = rollout_exactness(os.path.join(workdir, "rollout.jsonl"))
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    cluster.close()
    return results


def rollout_exactness(path: str) -> dict | None:
    """The exactness monitor of every training rollout in ``rollout.jsonl`` (resumed runs
    included), pooled: :func:`specjax.rl.study_stats.pooled_exactness_gap` (mean of
    ``log p + H`` per token, 0 for exact samples of the policy; a verdict from 30 rollouts on)."""
    from specjax.rl.study_stats import pooled_exactness_gap
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return pooled_exactness_gap([m.get("exactness_gap") for m in lines if m["mode"] == "train"])


def reward_trend(path: str) -> dict:
    """Per reward function in ``rewards.jsonl``: the mean reward of the first and the last quarter
    of the training steps (at least one step each), and the number of steps."""
    per_fn: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                per_fn.setdefault(r["reward"], {})[r["step"]] = r["mean"]
    out = {}
    for name, by_step in per_fn.items():
        means = [by_step[k] for k in sorted(by_step)]
        q = max(1, len(means) // 4)
        out[name] = {"steps": len(means), "first_quarter": sum(means[:q]) / q,
                     "last_quarter": sum(means[-q:]) / q}
    return out


def rollout_speed(rollout, prompts, rollout_config, repeats: int) -> dict:
    """Rollout tokens/s of ``prompts`` on the rollout's current weights: the speculative engine
    (``rollout.generate``) against the plain decoder (:func:`specjax.models.generate.generate_timed`,
    one jitted loop over the whole batch) at the same temperature and token budget.

    One untimed call each first (compilation), then ``repeats`` timed calls each, alternating;
    tokens are every generated token up to and including a stop token, for both; seconds are the
    sampling alone for both (the speculative rollout's teacher-forced scoring pass, which gives the
    learner its log-probs, is not included). Returns, per decoder, the per-call ``tokens`` and
    ``seconds`` and the median ``tokens_per_s``. The speculative calls are recorded in
    rollout.jsonl with mode "speed".
    """
    import numpy as np
    from flax import nnx

    from specjax.models.generate import generate_timed
    rc = rollout_config
    stops = list(rc.eos_tokens or [rollout.eos_id()])
    if len(stops) != 1:
        raise ValueError(f"rollout_speed: the plain decoder stops at one token, got {stops}")
    model = nnx.merge(rollout.engine.graphdef, rollout.engine.target_state)

    def spec():
        rollout.generate(prompts, rc, mode="speed")
        m = rollout.last_metrics
        return m["tokens"], m["wall_s"]

    def plain(seed):
        t0 = time.perf_counter()
        out = generate_timed(model, ids, rc.max_tokens_to_generate, temperature=rc.temperature,
                             eos_id=stops[0], seed=seed, max_len=rollout.engine.config.max_len)
        return sum(len(t) for t in out.tokens), time.perf_counter() - t0

    spec()
    ids = rollout.last_batch["prompts"]  # the token ids the engine was given
    plain(0)
    runs = {"speculative": [], "plain": []}
    for i in range(repeats):
        runs["speculative"].append(spec())
        runs["plain"].append(plain(i + 1))
    out = {"sequences": len(prompts), "max_new_tokens": rc.max_tokens_to_generate,
           "temperature": rc.temperature, "repeats": repeats}
    for name, rs in runs.items():
        out[name] = {"tokens": [t for t, _ in rs], "seconds": [s for _, s in rs],
                     "tokens_per_s": float(np.median([t / s for t, s in rs]))}
    return out


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    res = run(_CONFIG.value, _WORKDIR.value)
    print(json.dumps(res, indent=1), file=sys.stdout)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
