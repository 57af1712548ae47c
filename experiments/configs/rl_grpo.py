"""GRPO on the embedded math problems with speculative rollouts (Tunix + ``SpeculativeRollout``).

Run (from the repository root; the target is a finished ``pretrain_target.py`` workdir, the drafter
an optional ``train_drafter.py`` workdir trained against it)::

    python -m experiments.rl --config experiments/configs/rl_grpo.py \
        --config.target_workdir /tmp/specjax/pretrain_target \
        --config.drafter_workdir /tmp/specjax/drafter_mtp_e2e_tv_ws \
        --workdir /tmp/specjax/rl_grpo

Tiny mode (a random tiny target, a small math tokenizer, a fresh frozen MTP head, 2 GRPO steps;
seconds after compilation; used by the tests)::

    python -m experiments.rl --config experiments/configs/rl_grpo.py:tiny --workdir /tmp/specjax/rl_tiny

Re-running with the same workdir resumes from the newest Orbax checkpoint (Tunix's trainer
restores the policy, the optimizer and the data position). Outputs: ``rollout.jsonl`` (one line of
acceptance / τ / entropy / timing metrics per rollout), ``rewards.jsonl`` (mean reward per reward
function and training step), ``results.json`` (held-out accuracy before and after, greedy and
sampled, with the gains paired by problem: ``[gain, s.e.]``), TensorBoard event files under
``tensorboard/`` and checkpoints under ``checkpoints/``.
"""
import ml_collections


def get_config(arg: str | None = None):
    """``arg``: None / "" for the full run, "tiny" for the smoke run."""
    if arg not in (None, "", "tiny"):
        raise ValueError(f"rl_grpo: unknown mode {arg!r}; use '' or 'tiny'")
    c = ml_collections.ConfigDict()
    c.seed = 0
    # target: a pretrain_target.py workdir (its config.json and checkpoints); "" = random init of
    # `preset` (tiny mode) with a tokenizer trained on the math problems
    c.target_workdir = ""
    c.preset = "small"
    c.data_dir = ""  # tokenizer.json of the target's data (default: the target workdir's config)
    # drafter: a train_drafter.py workdir; "" = a freshly initialised MTP head ("mtp") or the
    # training-free n-gram drafter ("ngram"), per `drafter_kind`
    c.drafter_workdir = ""
    c.drafter_kind = "mtp"

    c.engine = ml_collections.ConfigDict()
    c.engine.method = "rejection"  # or "target_only"
    c.engine.gamma = 3
    c.engine.num_slots = 16
    c.engine.overlap = False  # False + a fixed draft length: acceptance per position is measured
    # compiled prompt chunk sizes, fed as specjax.buckets.plan_chunks plans; () = 8, 32, 128, ...
    # up to the longest prompt (specjax.buckets.prompt_chunk_buckets)
    c.engine.prefill_buckets = ()
    # device-loop calls and admissions run on the unfinished rollouts only, padded to a power of
    # two ("auto"; "none": every slot every call): a GRPO batch's sequences end at different
    # times (benchmarks/rl_rollout_speed.py, spec_rows); each row count compiles once more
    c.engine.row_buckets = "auto"

    c.task = ml_collections.ConfigDict()
    c.task.problem_seed = 1234
    c.task.n_train = 2000
    c.task.n_heldout = 200
    c.task.format_reward = 0.1  # 0 disables
    # "math": 1 for a correct answer (specjax.rl.task.correctness_reward); "digits": the fraction
    # of digits in the completion (task.digit_reward), a sanity check that GRPO raises a reward any
    # policy can raise (docs/RL.md)
    c.task.reward = "math"

    c.rl = ml_collections.ConfigDict()
    c.rl.steps = 100
    c.rl.prompts_per_step = 8
    c.rl.num_generations = 4  # G
    c.rl.learning_rate = 1e-5
    c.rl.beta = 0.0  # KL to the reference policy (0: no reference model)
    c.rl.epsilon = 0.2
    c.rl.temperature = 1.0
    c.rl.top_p = 1.0
    c.rl.max_prompt_length = 96
    c.rl.max_new_tokens = 64
    c.rl.checkpoint_every = 10
    c.rl.eval_max_new_tokens = 64
    # held-out evaluation before and after training: greedy, and this many completions per problem
    # sampled at `temperature` / `top_p` (the reward GRPO maximises; 0: greedy only)
    c.rl.eval_samples = 4
    # > 0: after training, time this many speculative and plain rollouts of one batch
    # (prompts_per_step x num_generations sequences) on the final policy (experiments.rl.rollout_speed)
    c.rl.speed_repeats = 0

    if arg == "tiny":
        c.preset = "tiny"
        c.task.n_train = 64
        c.task.n_heldout = 8
        c.engine.num_slots = 8
        c.engine.gamma = 2
        c.engine.prefill_buckets = (32,)  # one prefill compilation (prompts go in 32-token chunks)
        c.engine.row_buckets = "none"  # fewer compilations (the engine tests cover row buckets)
        c.rl.steps = 2
        c.rl.prompts_per_step = 2
        c.rl.num_generations = 4
        c.rl.learning_rate = 1e-3
        c.rl.max_new_tokens = 8
        c.rl.eval_max_new_tokens = 8
        c.rl.eval_samples = 2
        c.rl.checkpoint_every = 1
    return c
