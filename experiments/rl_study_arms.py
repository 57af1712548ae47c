"""One GRPO arm of the RL study (``experiments/rl_study.py``): Tunix GRPO with a recording rollout.

:class:`StudyRollout` is :class:`specjax.rl.SpeculativeRollout` plus what the study needs per RL
step: held-out accuracy every ``eval_every`` steps (before the step's rollout: the policy after the
previous update), greedy and, with ``eval_samples`` = k > 0, the mean reward of k samples per
held-out problem at the rollout temperature (what GRPO optimises; its s.e. clustered by
problem); cluster-robust errors of τ and entropy (clustered by sequence); the step's wall-clock
split (evaluations left out), and optionally one online drafter update on the step's rollouts
(:class:`specjax.rl.online.OnlineDrafterUpdate`). ``plain=True`` replaces speculative decoding by
the plain decoder (:func:`specjax.models.generate.generate`): the no-speculation arm.

After the last step a speculative arm's greedy evaluation is repeated through the plain decoder
(``heldout_end["greedy_plain_correct"]``, and ``greedy_text_same_as_plain`` per problem): at
temperature 0 both return the policy's argmax chain, so the greedy accuracy should not depend on
the drafter the arm evaluated with.
"""
from __future__ import annotations

import functools
import json
import os
import time

import numpy as np

from specjax.engine import Result
from specjax.rl.rollout import SpeculativeRollout
from specjax.rl.study_stats import clustered_ratio


class StudyRollout(SpeculativeRollout):
    def __init__(self, *args, plain=False, updater=None, eval_fn=None, eval_every=1, **kw):
        super().__init__(*args, **kw)
        self.records: list[dict] = []
        self._plain, self._updater, self._eval_fn = plain, updater, eval_fn
        self._eval_every = int(eval_every)
        self._opt_state = updater.init(self.engine.params) if updater is not None else None
        if plain:
            self.engine.generate = self._plain_generate

    def _plain_generate(self, requests):
        from specjax.models.generate import generate
        from flax import nnx
        model = nnx.merge(self.engine.graphdef, self.engine.target_state)
        r0 = requests[0]
        eos = r0.stop_tokens[0] if r0.stop_tokens else None
        t0 = time.perf_counter()
        toks = generate(model, [r.prompt for r in requests], r0.max_new_tokens,
                        temperature=r0.temperature, eos_id=eos, seed=r0.seed,
                        max_len=self.engine.config.max_len)
        now = time.perf_counter()
        return [Result(request_id=str(i), tokens=list(t), submit_time=t0, finish_time=now,
                       finish_reason="stop" if eos is not None and eos in t else "length",
                       steps=max(0, len(t) - 1)) for i, t in enumerate(toks)]

    def plain_text(self, prompts, rollout_config) -> list[str]:
        """Completions of ``prompts`` by the plain decoder (:func:`specjax.models.generate.
        generate`) through this rollout's own path (encoding, stop tokens, decoding), tagged
        ``mode="eval"`` in the log: what the speculative engine's output is checked against."""
        spec = self.engine.generate
        self.engine.generate = self._plain_generate
        try:
            return SpeculativeRollout.generate(self, prompts, rollout_config, mode="eval").text
        finally:
            self.engine.generate = spec

    def generate(self, prompts, rollout_config=None, *, mode="train", **kw):
        if mode != "train":
            return super().generate(prompts, rollout_config, mode=mode, **kw)
        step = len(self.records)
        rec = {"step": step}
        if self._eval_fn is not None and step % self._eval_every == 0:
            t0 = time.perf_counter()
            rec.update(self._eval_fn(self))
            rec["eval_s"] = time.perf_counter() - t0  # not part of the previous step's time
        rec["t_start"] = time.perf_counter()
        out = super().generate(prompts, rollout_config, mode=mode, **kw)
        m = self.last_metrics
        rec.update({k: m[k] for k in m if k != "mode"})
        res, ent = self.last_batch["results"], self.last_batch["entropy"]
        lens = np.array([len(r.tokens) for r in res], np.float64)
        steps = np.array([r.steps for r in res], np.float64)
        if not self._plain and steps.sum() > 0:
            rec["tau"], rec["tau_se"] = clustered_ratio(lens - 1, steps)
        else:
            rec["tau"], rec["tau_se"] = None, None
        if lens.sum() > 0:
            rec["entropy"], rec["entropy_se"] = clustered_ratio([e.sum() for e in ent], lens)
        rec["rollout_s"] = m["wall_s"]
        if self._updater is not None:
            rec.update(self._online_update())
        self.records.append(rec)
        return out

    def _online_update(self) -> dict:
        """One drafter step on this rollout's sequences (prompt + completion rows)."""
        import jax
        t0 = time.perf_counter()
        b = self.last_batch
        seqs = [list(p) + list(r.tokens) for p, r in zip(b["prompts"], b["results"])]
        length = self._config.max_prompt_length + self._config.max_tokens_to_generate
        rows = np.full((len(seqs), length), self.pad_id(), np.int32)
        valid = np.zeros_like(rows, bool)
        for i, s in enumerate(seqs):
            rows[i, :len(s)], valid[i, :len(s)] = s[:length], True
        params, self._opt_state, met = self._updater.step(
            self.engine.params, self._opt_state, self.engine.graphdef, self.engine.target_state,
            rows, valid)
        self.set_drafter_params(params)
        met = jax.device_get(met)
        return {"drafter_loss": float(met["loss"]), "drafter_grad_norm": float(met["grad_norm"]),
                "drafter_alpha_tf": float(met["alpha_mean"]),
                "drafter_update_s": time.perf_counter() - t0}


def study_engine_config(p, method: str, gamma=None):
    """The engine every arm rolls out with: ``p["num_slots"]`` slots, room for the longest prompt
    and completion plus one draft block, γ drafts per step (``p["gamma"]`` unless given)."""
    from specjax.buckets import prompt_chunk_buckets
    from specjax.engine import EngineConfig
    from specjax.scheduling import SchedulerConfig
    gamma = p["gamma"] if gamma is None else int(gamma)
    return EngineConfig(
        num_slots=p["num_slots"], max_len=p["max_prompt_length"] + p["max_new_tokens"] + gamma + 2,
        gamma=gamma, method="rejection" if method == "none" else method,
        # prompts are fed in chunks that pad them by fewer than 8 positions (35 tokens: 32 + 8;
        # one 128-position chunk made admitting a batch about 3x slower:
        # benchmarks/results/rl_rollout_speed*.json, prefill_s)
        prefill_buckets=prompt_chunk_buckets(p["max_prompt_length"]),
        scheduler=SchedulerConfig("fixed", k=gamma), overlap=False,
        # the study samples at a temperature alone: no top-k / top-p sort over the vocabulary in
        # the loop (it made every rollout 2.1-2.7x slower and changes no token:
        # benchmarks/rl_rollout_speed.py)
        filters=False)


def fresh_arm_dir(workdir: str) -> str:
    """Makes ``workdir`` for a run of one arm / seed, without an interrupted run's rollout log.

    The rollout engine appends to ``rollout.jsonl``; an arm is only run when its ``arm.json`` is
    missing, so a log found there is from a run that stopped before the end, and appending to it
    would read as one run of twice the steps."""
    os.makedirs(workdir, exist_ok=True)
    stale = os.path.join(workdir, "rollout.jsonl")
    if os.path.exists(stale):
        os.remove(stale)
    return workdir


def run_arm(arm: dict, seed: int, p, model, tok, drafter, dparams, workdir: str) -> dict:
    """Runs one GRPO arm / seed; returns ``{"records": [...], "heldout_accuracy_end", ...}``.

    ``arm``: ``{"name", "method": "none" | "rejection" | "target_only", "online": None | loss}``;
    ``p``: the mode's parameters (see ``rl_study.MODES``).
    """
    import jax
    import optax
    from flax import nnx
    from specjax.rl import require_tunix
    require_tunix()  # before Tunix's imports: an error that names the extra
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
    from tunix.rl.rollout.base_rollout import RolloutConfig

    from specjax.rl import TunixPolicy
    from specjax.rl import task as T
    from specjax.rl.online import OnlineDrafterUpdate

    fresh_arm_dir(workdir)
    train, heldout = T.split_problems(p["problem_seed"], p["n_train"], p["n_heldout"])
    ttok = T.TunixTokenizer(tok)
    gamma = p["gamma"]
    engine_config = study_engine_config(p, arm["method"])
    rc = RolloutConfig(max_tokens_to_generate=p["max_new_tokens"],
                       max_prompt_length=p["max_prompt_length"], temperature=p["temperature"],
                       eos_tokens=[ttok.eos_id()], seed=seed)
    eval_rc = RolloutConfig(max_tokens_to_generate=p["max_new_tokens"],
                            max_prompt_length=p["max_prompt_length"], temperature=0.0,
                            eos_tokens=[ttok.eos_id()])

    # the held-out reward GRPO optimises: k samples per problem at the rollout temperature
    sampled_rc = RolloutConfig(max_tokens_to_generate=p["max_new_tokens"],
                               max_prompt_length=p["max_prompt_length"],
                               temperature=p["temperature"], eos_tokens=[ttok.eos_id()],
                               seed=seed + T.EVAL_SEED_OFFSET)

    last_greedy: dict = {}  # the latest greedy evaluation's completions

    def eval_fn(rollout) -> dict:
        def gen(prompts, rc):
            out = rollout.generate(prompts, rc, mode="eval")
            if rc.temperature == 0:
                last_greedy["text"] = out.text
            return out
        with mesh:
            return T.heldout_eval(gen, heldout, eval_rc, sampled_rc, p["eval_samples"])

    updater = None
    if arm["online"]:
        updater = OnlineDrafterUpdate(drafter, arm["online"], learning_rate=p["drafter_lr"],
                                      gamma=gamma, max_grad_norm=1.0,
                                      temperature=p["temperature"])
    mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:1])
    tcfg = rl.RLTrainingConfig(actor_optimizer=optax.adamw(p["learning_rate"]),
                               eval_every_n_steps=10 ** 9, max_steps=p["rl_steps"])
    rollout_engine = functools.partial(
        StudyRollout, drafter=drafter, drafter_params=dparams, frozen="shared",
        engine_config=engine_config, seed=seed, plain=arm["method"] == "none", updater=updater,
        eval_fn=eval_fn, eval_every=p["eval_every"],
        metrics_jsonl=os.path.join(workdir, "rollout.jsonl"))
    cluster = rl.RLCluster(
        actor=TunixPolicy(model), reference=None, tokenizer=ttok,
        cluster_config=rl.ClusterConfig(
            role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
            rollout_engine=rollout_engine, offload_to_cpu=False, training_config=tcfg,
            rollout_config=rc))
    rollout = cluster.rollout
    rewards_log: list[dict] = []

    def correct(prompts, completions, answer, **kw):
        t0 = time.perf_counter()
        r = T.correctness_reward(prompts, completions, answer)
        rewards_log.append({"reward": float(np.mean(r)), "reward_s": time.perf_counter() - t0})
        return r

    learner = GRPOLearner(rl_cluster=cluster, reward_fns=[correct], algo_config=GRPOConfig(
        num_generations=p["num_generations"], num_iterations=1, beta=0.0, epsilon=0.2))
    rollout.update_params(nnx.state(rollout.model(), nnx.Param))
    t0 = time.perf_counter()
    learner.train(T.batches(train, p["prompts_per_step"], seed, p["rl_steps"]))
    t_end = time.perf_counter()
    rollout.update_params(nnx.state(rollout.model(), nnx.Param))
    end = eval_fn(rollout)
    if arm["method"] != "none":
        # The final policy's greedy answers again through the plain decoder. At temperature 0
        # speculative decoding returns the policy's argmax chain, so the texts should match;
        # a mismatch (a float near-tie resolved differently, or a fault) would make the greedy
        # accuracy depend on the drafter.
        with mesh:
            plain = rollout.plain_text([q.prompt for q in heldout], eval_rc)
        end["greedy_plain_correct"] = T.accuracy_per_problem(plain, heldout, 1).astype(
            int).tolist()
        end["greedy_text_same_as_plain"] = [int(a == b) for a, b in
                                            zip(last_greedy["text"], plain)]
    recs = rollout.records
    for i, r in enumerate(recs):
        # the next step's evaluation runs before its t_start: not this step's time
        nxt = recs[i + 1]["t_start"] - recs[i + 1].get("eval_s", 0.0) if i + 1 < len(recs) \
            else t_end
        r["step_s"] = nxt - r.pop("t_start")
        r.update(rewards_log[i] if i < len(rewards_log) else {})
        r["update_s"] = r["step_s"] - r["rollout_s"] - r.get("reward_s", 0.0) - \
            r.get("drafter_update_s", 0.0)
    out = {"arm": arm["name"], "seed": seed, "records": recs,
           "heldout_accuracy_end": end.pop("heldout_accuracy"), "heldout_end": end,
           "n_heldout": len(heldout), "train_seconds": t_end - t0}
    with open(os.path.join(workdir, "arm.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out
