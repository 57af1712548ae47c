"""The verifiable-reward task: the embedded math word problems, graded by their exact answers.

A completion scores 1 when its first ``#### <n>`` line holds the problem's answer
(:func:`specjax.data.math_problems.check_answer`), else 0; an optional format reward adds a small
bonus for producing an answer line at all. Train and held-out prompts are disjoint (no question
text in both).

Batches are what Tunix's learner consumes: dicts of numpy arrays, ``"prompts"`` (text) and
``"answer"`` (ints, passed on to the reward functions as a keyword argument).
"""
from __future__ import annotations

import random
from typing import Iterator, Sequence

import numpy as np

from specjax.data.math_problems import MathProblem, check_answer, extract_answer, math_problems
from specjax.rl.study_stats import mean_se

# Seed offset of the sampled held-out evaluation (added to the run's seed), so that it draws apart
# from the training rollouts.
EVAL_SEED_OFFSET = 10_000

__all__ = ["TunixTokenizer", "split_problems", "batches", "correctness_reward", "format_reward",
           "accuracy", "accuracy_per_problem", "heldout_eval", "paired_gain", "EVAL_SEED_OFFSET"]


class TunixTokenizer:
    """A specjax :class:`~specjax.data.tokenizer.Tokenizer` with the methods Tunix calls.

    ``bos_id`` is the end-of-text id: specjax's documents start after an EOS separator, so every
    prompt is conditioned the way training documents were.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str, **kwargs) -> list[int]:
        return self.tokenizer.encode(str(text))

    def decode(self, ids, **kwargs) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def bos_id(self) -> int:
        return self.tokenizer.eos_id

    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def pad_id(self) -> int:
        return self.tokenizer.pad_id


def split_problems(seed: int, n_train: int, n_heldout: int) -> tuple[list[MathProblem],
                                                                     list[MathProblem]]:
    """Disjoint train / held-out problems (held-out first, so it does not move with n_train)."""
    if n_train < 1 or n_heldout < 1:
        raise ValueError(f"n_train and n_heldout must be >= 1, got {n_train}, {n_heldout}")
    pool = math_problems(seed, 2 * (n_train + n_heldout))
    seen, uniq = set(), []
    for p in pool:
        if p.question not in seen:
            seen.add(p.question)
            uniq.append(p)
    if len(uniq) < n_train + n_heldout:
        raise ValueError(f"only {len(uniq)} distinct problems for seed {seed}")
    return uniq[n_heldout:n_heldout + n_train], uniq[:n_heldout]


def batches(problems: Sequence[MathProblem], batch_size: int, seed: int,
            num_batches: int) -> Iterator[dict]:
    """``num_batches`` batches of ``batch_size`` prompts, reshuffled every pass (seeded)."""
    if not 0 < batch_size <= len(problems):
        raise ValueError(f"batch_size must be in [1, {len(problems)}], got {batch_size}")
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(num_batches):
        if len(order) < batch_size:
            extra = list(range(len(problems)))
            rng.shuffle(extra)
            order += extra
        idx, order = order[:batch_size], order[batch_size:]
        # numpy arrays, not lists: Tunix repeats every leaf of the batch G times (a list of
        # strings would be a pytree of string leaves, each turned into an array of G copies)
        yield {"prompts": np.array([problems[i].prompt for i in idx]),
               "answer": np.array([problems[i].answer for i in idx], np.int64)}


def correctness_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's first answer line is the right answer, else 0.0."""
    return [float(check_answer(int(a), c)) for a, c in zip(answer, completions)]


def digit_reward(prompts, completions, **kwargs) -> list[float]:
    """Fraction of the completion's characters that are digits (0 for an empty completion).

    A sanity reward, not a task: any policy can raise it by writing more digits, so a GRPO run
    on it that does not raise it points at the learning machinery, not at the policy."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]


def format_reward(prompts, completions, weight: float = 0.1, **kwargs) -> list[float]:
    """``weight`` where the completion has an answer line ``#### <n>``, else 0."""
    return [weight if extract_answer(c) is not None else 0.0 for c in completions]


def accuracy(completions: Sequence[str], problems: Sequence[MathProblem]) -> float:
    """Fraction of completions that answer their problem correctly."""
    if not problems:
        raise ValueError("no problems")
    return sum(check_answer(p, c) for p, c in zip(problems, completions)) / len(problems)


def accuracy_per_problem(completions: Sequence[str], problems: Sequence[MathProblem],
                         samples: int) -> np.ndarray:
    """``[len(problems)]`` fraction of correct completions per problem.

    ``completions`` holds ``samples`` completions per problem, problem-major (problem 0's
    ``samples`` completions first). The per-problem means are the clusters of an honest standard
    error: completions of one problem are correlated (the problem's difficulty), so the error of
    the overall mean is ``std(per-problem means) / sqrt(len(problems))``, not a binomial one over
    every completion."""
    if samples < 1 or not problems:
        raise ValueError(f"need samples >= 1 and problems, got {samples}, {len(problems)}")
    if len(completions) != samples * len(problems):
        raise ValueError(f"{len(completions)} completions for {len(problems)} problems x "
                         f"{samples} samples")
    ok = np.array([check_answer(problems[i // samples].answer, c)
                   for i, c in enumerate(completions)], np.float64)
    return ok.reshape(len(problems), samples).mean(axis=1)


def heldout_eval(generate, problems: Sequence[MathProblem], greedy_config,
                 sampled_config=None, samples: int = 0) -> dict:
    """Held-out accuracy of the policy behind ``generate``, greedy and (``samples`` > 0) sampled.

    Args:
      generate: ``generate(prompts, rollout_config) -> out`` with ``out.text`` the completions
        (``SpeculativeRollout.generate`` with ``mode="eval"``).
      problems: the held-out problems.
      greedy_config: a rollout config at temperature 0.
      sampled_config: the rollout config of the sampled evaluation (the RL temperature: the
        held-out reward GRPO maximises); needed when ``samples`` > 0.
      samples: completions per problem in the sampled evaluation (0: greedy only).
    Returns:
      ``heldout_accuracy`` and ``heldout_correct`` (``[n]`` 0/1 per problem); with samples also
      ``heldout_sampled_accuracy``, its s.e. over problems ``heldout_sampled_se`` and
      ``heldout_sampled_per_problem`` (``[n]`` fractions), so that a change is paired by problem
      (:func:`paired_gain`).
    """
    prompts = [q.prompt for q in problems]
    correct = accuracy_per_problem(generate(prompts, greedy_config).text, problems, 1)
    out = {"heldout_accuracy": float(correct.mean()),
           "heldout_correct": correct.astype(int).tolist()}
    if samples:
        if sampled_config is None:
            raise ValueError("samples > 0 needs a sampled_config")
        text = generate([p for p in prompts for _ in range(samples)], sampled_config).text
        per = accuracy_per_problem(text, problems, samples)
        acc, se = mean_se(per)
        out.update(heldout_sampled_accuracy=acc, heldout_sampled_se=se,
                   heldout_sampled_per_problem=per.tolist())
    return out


def paired_gain(before, after) -> tuple[float, float]:
    """``(mean, s.e.)`` of ``after - before`` over problems (``[n]`` per-problem values, the same
    problems in the same order): a change in accuracy paired by problem, whose s.e. is the
    evaluation's noise (nan for one problem)."""
    if np.ndim(before) != 1 or np.shape(before) != np.shape(after) or np.size(before) == 0:
        raise ValueError(f"want equal non-empty [n] values, got {np.shape(before)}, "
                         f"{np.shape(after)}")
    return mean_se(np.asarray(after, np.float64) - np.asarray(before, np.float64))
