"""Generated grade-school arithmetic word problems with worked solutions (the *math* domain).

This is specjax's verifiable task: every problem has an exact integer answer, the worked solution
ends in a GSM8K-style answer line ``#### <answer>``, and :func:`check_answer` grades a model's
completion. The RL work (GRPO with speculative rollouts) uses it as its reward.

A problem rendered as a training document (:attr:`MathProblem.text`)::

    Question: Mia has 23 marbles. She gets 14 more. How many marbles does Mia have now?
    Answer: Mia starts with 23 marbles and gets 14 more.
    23 + 14 = 37
    #### 37

``MathProblem.prompt`` is everything up to and including ``"Answer:"``; a completion is what
follows it. Problems are kept short (about 40-80 tokens with the default tokenizer) and the
numbers small (operands up to 99, factors up to 12, answers up to a few hundred) so that a tiny
model trained for minutes on a CPU can learn them. Templates: add, subtract, multiply, divide and
five two-step forms. Generation uses :class:`random.Random`, whose integer-seeded stream is stable
across CPython 3 releases, so ``math_problems(seed, n)`` is the same list everywhere.
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Callable

__all__ = [
    "ANSWER_PREFIX",
    "MathProblem",
    "math_problems",
    "extract_answer",
    "check_answer",
]

ANSWER_PREFIX = "####"

# (name, subject pronoun)
_PEOPLE = (
    ("Mia", "She"), ("Noah", "He"), ("Ava", "She"), ("Liam", "He"),
    ("Zoe", "She"), ("Omar", "He"), ("Lena", "She"), ("Ravi", "He"),
    ("Sofia", "She"), ("Ben", "He"), ("Aisha", "She"), ("Jonas", "He"),
    ("Emma", "She"), ("Kenji", "He"), ("Chloe", "She"), ("Leo", "He"),
    ("Nora", "She"), ("Sam", "He"), ("Ines", "She"), ("Theo", "He"),
)
_ITEMS = ("apples", "marbles", "stickers", "pencils", "books", "cookies", "cards", "shells",
          "stamps", "balloons", "beads", "crayons", "eggs", "oranges", "coins", "toy cars")
_CONTAINERS = ("boxes", "bags", "baskets", "jars", "packs", "trays", "crates", "bowls")
_GOODS = (("notebook", "notebooks"), ("pen", "pens"), ("sandwich", "sandwiches"),
          ("ticket", "tickets"), ("kite", "kites"), ("mug", "mugs"), ("puzzle", "puzzles"),
          ("plant", "plants"), ("comic", "comics"), ("ball", "balls"))
_RATES = (("reads", "pages"), ("walks", "kilometers"), ("bakes", "muffins"),
          ("writes", "lines of poetry"), ("saves", "dollars"), ("plants", "flowers"))


@dataclasses.dataclass(frozen=True)
class MathProblem:
    """One arithmetic word problem.

    Attributes:
      question: the problem statement (one or a few sentences, no newline).
      solution: step-by-step worked solution; its last line is ``"#### <answer>"``.
      answer: the exact integer answer (always >= 0).
    """

    question: str
    solution: str
    answer: int

    @property
    def prompt(self) -> str:
        """The text a model is conditioned on: ``"Question: ...\\nAnswer:"``."""
        return f"Question: {self.question}\nAnswer:"

    @property
    def text(self) -> str:
        """The full training document: prompt, a space, then the worked solution."""
        return f"{self.prompt} {self.solution}"


_ANSWER_RE = re.compile(re.escape(ANSWER_PREFIX) + r"[ \t]*(-?\d[\d,]*)")


def extract_answer(text: str) -> int | None:
    """Return the integer on the first ``#### <n>`` line of ``text``, or None if there is none.

    The *first* answer line counts: a model that keeps generating past its answer (for example
    into a new "Question:") is graded on what it answered first. Thousands separators are
    accepted ("#### 1,200" -> 1200).
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects str, got {type(text).__name__}")
    match = _ANSWER_RE.search(text)
    if match is None:
        return None
    return int(match.group(1).replace(",", ""))


def check_answer(problem: MathProblem | int, completion: str) -> bool:
    """True iff ``completion``'s first ``#### <n>`` answer equals the problem's answer.

    Args:
      problem: a :class:`MathProblem` or the expected integer answer.
      completion: model output (the text after ``problem.prompt``), or a whole document.
    """
    expected = problem.answer if isinstance(problem, MathProblem) else problem
    if isinstance(expected, bool) or not isinstance(expected, int):
        raise TypeError(f"check_answer expects a MathProblem or int, got {type(problem).__name__}")
    got = extract_answer(completion)
    return got is not None and got == expected


# --- templates: each draws numbers from rng and returns (question, solution steps, answer) ---

Template = Callable[[random.Random], tuple[str, list[str], int]]


def _person(rng):
    return rng.choice(_PEOPLE)


def _add(rng):
    (n, pron), a, b, item = _person(rng), rng.randint(2, 99), rng.randint(2, 99), rng.choice(_ITEMS)
    q = f"{n} has {a} {item}. {pron} gets {b} more. How many {item} does {n} have now?"
    return q, [f"{n} starts with {a} {item} and gets {b} more.", f"{a} + {b} = {a + b}"], a + b


def _subtract(rng):
    n, friend = _two_people(rng)
    a = rng.randint(10, 99)
    b = rng.randint(2, a - 1)
    item = rng.choice(_ITEMS)
    q = f"{n} had {a} {item} and gave {b} of them to {friend}. How many {item} does {n} have left?"
    return q, [f"{n} gives away {b} of {a} {item}.", f"{a} - {b} = {a - b}"], a - b


def _multiply(rng):
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    box, item = rng.choice(_CONTAINERS), rng.choice(_ITEMS)
    q = f"There are {a} {box} with {b} {item} in each. How many {item} are there in total?"
    return q, [f"{a} {box} with {b} {item} each make {a} * {b} = {a * b} {item}."], a * b


def _divide(rng):
    k, each = rng.randint(2, 12), rng.randint(2, 12)
    total, item = k * each, rng.choice(_ITEMS)
    n = _person(rng)[0]
    q = (f"{n} shares {total} {item} equally among {k} friends. "
         f"How many {item} does each friend get?")
    return q, [f"{total} {item} split into {k} equal shares.", f"{total} / {k} = {each}"], each


def _buy(rng):
    (n, _), (one, many) = _person(rng), rng.choice(_GOODS)
    price, count = rng.randint(2, 15), rng.randint(2, 9)
    q = f"A {one} costs {price} dollars. {n} buys {count} {many}. How many dollars does {n} spend?"
    return q, [f"{count} {many} at {price} dollars each cost {count} * {price} = {count * price}."], \
        count * price


def _rate(rng):
    (n, _), (verb, unit) = _person(rng), rng.choice(_RATES)
    per_day, days = rng.randint(2, 20), rng.randint(2, 9)
    # Every verb in _RATES forms its infinitive by dropping the final "s" (reads -> read).
    q = f"{n} {verb} {per_day} {unit} every day. How many {unit} does {n} {verb[:-1]} in {days} days?"
    return q, [f"{per_day} {unit} a day for {days} days is {per_day} * {days} = {per_day * days}."], \
        per_day * days


def _add_then_subtract(rng):
    (n, pron), item = _person(rng), rng.choice(_ITEMS)
    a, b = rng.randint(5, 60), rng.randint(2, 40)
    c = rng.randint(2, a + b - 1)
    q = (f"{n} has {a} {item}. {pron} buys {b} more and then gives away {c}. "
         f"How many {item} does {n} have now?")
    steps = [f"After buying, {n} has {a} + {b} = {a + b} {item}.",
             f"After giving away {c}, {n} has {a + b} - {c} = {a + b - c} {item}."]
    return q, steps, a + b - c


def _packs_plus(rng):
    (n, pron), item = _person(rng), rng.choice(_ITEMS)
    packs, per, had = rng.randint(2, 9), rng.randint(2, 12), rng.randint(2, 50)
    q = (f"{n} buys {packs} packs of {item} with {per} in each pack. {pron} already had {had} {item}. "
         f"How many {item} does {n} have now?")
    steps = [f"The packs hold {packs} * {per} = {packs * per} {item}.",
             f"{packs * per} + {had} = {packs * per + had}"]
    return q, steps, packs * per + had


def _change(rng):
    (n, _), (one, many) = _person(rng), rng.choice(_GOODS)
    price, count = rng.randint(2, 12), rng.randint(2, 6)
    money = count * price + rng.randint(0, 40)
    q = (f"{n} has {money} dollars and buys {count} {many} that cost {price} dollars each. "
         f"How many dollars does {n} have left?")
    steps = [f"The {many} cost {count} * {price} = {count * price} dollars.",
             f"{money} - {count * price} = {money - count * price}"]
    return q, steps, money - count * price


def _boxes_left(rng):
    (n, _), item, box = _person(rng), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    per, boxes = rng.randint(2, 12), rng.randint(3, 12)
    sold = rng.randint(1, boxes - 1)
    q = (f"{boxes * per} {item} are packed into {box} of {per}. {n} sells {sold} of the {box}. "
         f"How many {box} are left?")
    steps = [f"There are {boxes * per} / {per} = {boxes} {box}.", f"{boxes} - {sold} = {boxes - sold}"]
    return q, steps, boxes - sold


def _together(rng):
    n, m = _two_people(rng)
    item = rng.choice(_ITEMS)
    a, more = rng.randint(2, 50), rng.randint(2, 30)
    q = (f"{n} has {a} {item}. {m} has {more} more {item} than {n}. "
         f"How many {item} do they have together?")
    steps = [f"{m} has {a} + {more} = {a + more} {item}.",
             f"Together they have {a} + {a + more} = {2 * a + more} {item}."]
    return q, steps, 2 * a + more


def _two_people(rng):
    first = rng.randrange(len(_PEOPLE))
    second = (first + rng.randrange(1, len(_PEOPLE))) % len(_PEOPLE)  # always a different person
    return _PEOPLE[first][0], _PEOPLE[second][0]


# Order matters for reproducibility: the template index is drawn from rng.
_TEMPLATES: tuple[Template, ...] = (
    _add, _subtract, _multiply, _divide, _buy, _rate,
    _add_then_subtract, _packs_plus, _change, _boxes_left, _together,
)


def math_problems(seed: int, n: int) -> list[MathProblem]:
    """Generate ``n`` problems, deterministically from ``seed`` (templates drawn uniformly).

    Duplicates are possible (the corpus deduplicates by question); the list depends only on
    ``(seed, n)`` and a prefix property holds: ``math_problems(s, n)[:k] == math_problems(s, k)``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        question, steps, answer = rng.choice(_TEMPLATES)(rng)
        solution = "\n".join([*steps, f"{ANSWER_PREFIX} {answer}"])
        problems.append(MathProblem(question=question, solution=solution, answer=answer))
    return problems
