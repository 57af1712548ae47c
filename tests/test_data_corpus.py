"""Embedded corpus and math problems: determinism, disjoint splits, verifiable answers."""
import os
import time

import pytest

from specjax.data import corpus
from specjax.data.math_problems import (MathProblem, check_answer, extract_answer,
                                        math_problems)


# --- math -------------------------------------------------------------------------------------


def test_every_generated_solution_checks_and_wrong_answers_fail():
    problems = math_problems(seed=7, n=3000)
    for p in problems:
        assert isinstance(p.answer, int) and p.answer >= 0
        assert check_answer(p, p.solution), p
        assert check_answer(p, p.text)  # The whole document grades too.
        assert extract_answer(p.solution) == p.answer
        assert not check_answer(p, p.solution.replace(f"#### {p.answer}", f"#### {p.answer + 1}"))
        assert not check_answer(p, p.solution.split("####")[0])  # No answer line: wrong.
        assert p.text.startswith(p.prompt) and p.prompt.endswith("\nAnswer:")
        assert len(p.text) < 400  # Short enough for a tiny model's context.


def test_math_worked_steps_are_true_equations():
    # Every "a op b = c" in a solution must be arithmetically correct (the model learns from it).
    import re

    eq = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: a / b}
    n_eq = 0
    for p in math_problems(seed=3, n=2000):
        for a, op, b, c in eq.findall(p.solution):
            assert ops[op](int(a), int(b)) == int(c), p.solution
            n_eq += 1
    assert n_eq > 2000


def test_math_problems_are_deterministic_and_varied():
    a, b = math_problems(11, 500), math_problems(11, 500)
    assert a == b
    assert math_problems(11, 100) == a[:100]  # Prefix property.
    assert math_problems(12, 100) != a[:100]
    # Several templates and operations appear.
    sols = "\n".join(p.solution for p in a)
    for op in (" + ", " - ", " * ", " / "):
        assert op in sols
    assert sum("\n" in p.solution.split("####")[0].strip() for p in a) > 100  # multi-step
    assert len({p.question.split()[1] for p in a}) > 5


def test_extract_answer_edge_cases():
    assert extract_answer("so 3 + 4 = 7\n#### 7") == 7
    assert extract_answer("####7") == 7
    assert extract_answer("#### 1,200 dollars") == 1200
    assert extract_answer("#### -3") == -3
    assert extract_answer("#### 5\nQuestion: ...\n#### 9") == 5  # First answer counts.
    assert extract_answer("the answer is 7") is None
    assert extract_answer("#### seven") is None
    assert check_answer(7, "#### 7") and not check_answer(7, "#### 8")
    with pytest.raises(TypeError):
        check_answer("7", "#### 7")
    with pytest.raises(ValueError):
        math_problems(0, -1)


def test_math_problem_record():
    p = MathProblem(question="Q?", solution="1 + 1 = 2\n#### 2", answer=2)
    assert p.prompt == "Question: Q?\nAnswer:"
    assert p.text == "Question: Q?\nAnswer: 1 + 1 = 2\n#### 2"


# --- corpus -----------------------------------------------------------------------------------


@pytest.mark.parametrize("domain", corpus.DOMAINS)
def test_splits_do_not_overlap_and_are_nonempty(domain):
    train = corpus.load_documents(domain, "train")
    held = corpus.load_documents(domain, "heldout")
    assert len(train) > 200 and len(held) > 20
    assert len(held) < 0.1 * len(train)
    assert not {d.key for d in train} & {d.key for d in held}
    assert not {d.text for d in train} & {d.text for d in held}
    assert len({d.key for d in train}) == len(train)  # keys are unique
    for d in train[:50] + held[:50]:
        assert len(d.text) <= corpus.MAX_DOC_CHARS
        assert len(d.text.strip()) >= corpus.MIN_DOC_CHARS


def test_code_files_never_straddle_splits():
    # Code chunks and docstrings of one stdlib file share a split (no leakage via docstrings).
    def files(domain, split):
        return {d.key.split(":", 1)[1].rsplit("#", 1)[0]
                for d in corpus.load_documents(domain, split) if not d.key.startswith("topic:")}

    code_train, code_held = files("code", "train"), files("code", "heldout")
    prose_train, prose_held = files("prose", "train"), files("prose", "heldout")
    assert not code_train & code_held
    assert not code_train & prose_held
    assert not code_held & prose_train


def test_math_questions_never_straddle_splits():
    q = lambda split: {t.split("\nAnswer:")[0] for t in corpus.load_corpus("math", split)}  # noqa: E731
    assert not q("train") & q("heldout")


def test_corpus_content_looks_right():
    code = corpus.load_corpus("code", "train")
    assert any("def " in t for t in code) and any("class " in t for t in code)
    code_keys = [d.key for d in corpus.load_documents("code", "train")]
    assert not any("/test" in k or "site-packages" in k or "tkinter" in k for k in code_keys)
    assert code_keys == sorted(code_keys, key=lambda k: (k.rsplit("#", 1)[0], int(k.rsplit("#", 1)[1])))
    prose = corpus.load_corpus("prose", "train")
    assert sum(len(t) for t in prose) > 500_000
    assert any(d.key.startswith("topic:") for d in corpus.load_documents("prose", "train"))
    math = corpus.load_corpus("math", "train")
    assert all(t.startswith("Question: ") and "\n#### " in t for t in math)
    sizes = {d: sum(len(t) for t in corpus.load_corpus(d)) for d in corpus.DOMAINS}
    assert all(1_000_000 < s < 4_000_000 for s in sizes.values()), sizes


def test_corpus_is_independent_of_listing_order(monkeypatch):
    files_before = corpus._eligible_files()
    code_before = corpus.load_documents("code", "train") + corpus.load_documents("code", "heldout")
    real_walk = os.walk

    def reversed_walk(top, *args, **kwargs):
        for dirpath, dirnames, filenames in real_walk(top, *args, **kwargs):
            dirnames.reverse()  # In place: the caller's pruning still applies to this list.
            yield dirpath, dirnames, filenames[::-1]

    monkeypatch.setattr(corpus.os, "walk", reversed_walk)
    corpus._eligible_files.cache_clear()
    try:
        assert corpus._eligible_files() == files_before
        # Uncached rebuild of the code domain (leaves the other domains' cache alone).
        code_after = corpus._split_domain.__wrapped__("code")
    finally:
        corpus._eligible_files.cache_clear()
    assert list(code_after["train"]) + list(code_after["heldout"]) == code_before


def test_load_corpus_is_fast_when_cached_and_max_docs_is_a_prefix():
    corpus.load_corpus("prose")
    t0 = time.perf_counter()
    for d in corpus.DOMAINS:
        full = corpus.load_corpus(d)
        assert corpus.load_corpus(d, max_docs=5) == full[:5]
    assert time.perf_counter() - t0 < 2.0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="domain"):
        corpus.load_corpus("chat")
    with pytest.raises(ValueError, match="split"):
        corpus.load_corpus("math", "test")
    with pytest.raises(ValueError, match="max_docs"):
        corpus.load_corpus("math", max_docs=-1)


@pytest.mark.parametrize("max_chars", [1, 7, 64, 2048])
def test_split_text_is_lossless_and_bounded(max_chars):
    text = corpus.load_corpus("code")[0] + "\n\n" + "x" * 5000 + "\n\nclass A:\n    pass\n"
    pieces = corpus.split_text(text, max_chars)
    assert "".join(pieces) == text
    assert all(0 < len(p) <= max_chars for p in pieces)


def test_split_text_prefers_top_level_boundaries():
    blocks = [f"def f{i}():\n    return {i}\n\n" for i in range(100)]
    pieces = corpus.split_text("".join(blocks), 200)
    assert all(p.startswith("def f") for p in pieces)
