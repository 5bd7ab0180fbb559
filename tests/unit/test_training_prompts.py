"""Offline questions for the target: code instructions from source via ast, templated math problems, mixing."""

import re

import pytest

from sgl_dspark.training.prompts import (MATH_TEMPLATES, CodeItem, code_instruction, code_instructions, code_items,
                                         interleave, math_problems, mix, mixed_questions, module_name,
                                         share_counts, summary_of, third_person)

SOURCE = '''
def mean(data, *, weights=None):
    """Return the arithmetic mean of data.

    Longer explanation that is not used.
    """
    return sum(data) / len(data)


def _private(x):
    """Return x, but private."""


def undocumented(x):
    return x


class Stack:
    """A last-in, first-out stack of items."""

    def __init__(self, items=()):
        self.items = list(items)

    def push(self, item):
        """Add one item on top of the stack."""
        self.items.append(item)
'''


def test_code_items_are_the_public_documented_definitions_in_source_order():
    items = code_items(SOURCE, "stats")
    assert [(i.qualname, i.kind, i.signature) for i in items] == [
        ("mean", "function", "mean(data, *, weights=None)"),
        ("Stack", "class", "Stack(items=())"),
        ("Stack.push", "method", "push(item)"),
    ]
    assert items[0].summary == "Return the arithmetic mean of data."
    assert items[2].source.startswith("def push(self, item):\n    \"\"\"Add")
    assert code_items("def broken(:\n", "m") == []


def test_instruction_templates_fill_in_the_item():
    mean, stack, push = code_items(SOURCE, "stats")
    assert code_instruction(mean, 0) == \
        "Write a Python function `mean(data, *, weights=None)` that returns the arithmetic mean of data."
    assert code_instruction(push, 0) == \
        "Write a method `push(item)` of a Python class `Stack` that adds one item on top of the stack."
    assert code_instruction(stack, 0).startswith("Implement a Python class `Stack(items=())`. Its documentation says")
    assert code_instruction(mean, 2).endswith("```python\n" + mean.source + "\n```")
    long = CodeItem("m", "f", "function", "f()", "Return one.", "x = 1\n" * 400)
    assert code_instruction(long, 2) == code_instruction(long, 4)  # too long to show: the next template that fits


def test_docstring_summaries_and_clauses():
    assert summary_of("Return the mean.\n\n  More.") is None  # shorter than 20 characters
    assert summary_of("  Split a path into\n  head and tail.\n\nMore.") == "Split a path into head and tail."
    assert summary_of("mean(data) -> float\n\nReturn it.") is None
    assert third_person("Apply f to each item in turn.") == "applies f to each item in turn."
    assert third_person("Returns the head and the tail") == "returns the head and the tail."
    assert third_person("Matches a pattern at the start.") == "matches a pattern at the start."
    assert third_person("A stack of items.") is None


def test_module_names(tmp_path):
    assert module_name(tmp_path / "json" / "encoder.py", tmp_path) == "json.encoder"
    assert module_name(tmp_path / "json" / "__init__.py", tmp_path) == "json"


def test_code_instructions_are_deterministic_distinct_and_prefix_stable(tmp_path):
    (tmp_path / "stats.py").write_text(SOURCE)
    (tmp_path / "shapes.py").write_text('def area(w, h):\n    """Return the area of a w by h rectangle."""\n')
    files = [tmp_path / "stats.py", tmp_path / "shapes.py"]
    got = code_instructions(10, seed=0, files=files)
    assert len(got) == 4 == len(set(got))  # all four items, once each
    assert code_instructions(10, seed=0, files=files[::-1]) == got
    assert code_instructions(2, seed=0, files=files) == got[:2]


def test_math_problems_are_deterministic_distinct_and_filled_in():
    problems = math_problems(60, seed=3)
    assert len(problems) == 60 == len(set(problems))
    assert problems == math_problems(60, seed=3) and problems != math_problems(60, seed=4)
    assert math_problems(7, seed=3) == problems[:7]
    assert all(re.search(r"\d", p) and "{" not in p and "}" not in p for p in problems)
    assert len(MATH_TEMPLATES) >= 10


def test_linear_equations_have_whole_number_answers():
    import random

    from sgl_dspark.training.prompts import _linear

    rng = random.Random(0)
    for _ in range(40):
        m = re.fullmatch(r"Solve for x: (\d+)x \+ (\d+) = (-?\d+)\.", _linear(rng))
        if m:
            a, b, c = map(int, m.groups())
            assert (c - b) % a == 0


def test_share_counts_sum_to_the_total():
    assert share_counts(10, {"sharegpt": 0.5, "code": 0.3, "math": 0.2}) == {"sharegpt": 5, "code": 3, "math": 2}
    assert share_counts(2, {"a": 1, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 0}
    assert share_counts(7, {"a": 2, "b": 1}) == {"a": 5, "b": 2}
    with pytest.raises(ValueError):
        share_counts(5, {"a": 0})


def test_interleave_spreads_each_source_in_its_own_order():
    assert interleave({"a": ["a1", "a2", "a3", "a4"], "b": ["b1", "b2"]}) == [
        ("a", "a1"), ("b", "b1"), ("a", "a2"), ("a", "a3"), ("b", "b2"), ("a", "a4")]
    assert interleave({"a": ["a1", "a2"]}) == [("a", "a1"), ("a", "a2")]


def fake_generators():
    return {src: (lambda n, seed, src=src: [f"{src}{seed}-{i}" for i in range(n)])
            for src in ("sharegpt", "code", "math")}


def test_mixing_reads_only_the_sources_asked_for():
    calls = []
    gens = {**fake_generators(), "sharegpt": lambda n, seed: calls.append(n) or []}
    assert mix({"sharegpt": 0, "code": 1, "math": 2}, seed=1, generators=gens) == [
        ("math", "math1-0"), ("code", "code1-0"), ("math", "math1-1")]
    assert calls == []
    with pytest.raises(ValueError, match="unknown question sources"):
        mix({"wiki": 3}, seed=0, generators=gens)


def test_mixed_questions_take_the_shares():
    got = mixed_questions(10, {"sharegpt": 0.5, "code": 0.3, "math": 0.2}, seed=0, generators=fake_generators())
    assert len(got) == 10
    assert [src for src, _ in got].count("code") == 3 and [src for src, _ in got].count("math") == 2


def test_completion_problems_show_a_documented_functions_signature_and_docstring_only(tmp_path):
    from sgl_dspark.training.prompts import COMPLETION_ASKS, completion_problems, function_stub

    mean, stack, push = code_items(SOURCE, "stats")
    assert function_stub(mean) == 'def mean(data, *, weights=None):\n    """Return the arithmetic mean of data.\n\n' \
        '    Longer explanation that is not used.\n    """\n'  # the body (`return ...`) left out
    assert function_stub(stack) is None and function_stub(push) is None  # classes and methods need their class
    (tmp_path / "stats.py").write_text(SOURCE)
    (tmp_path / "shapes.py").write_text('def area(w, h):\n    """Return the area of a w by h rectangle."""\n'
                                        '    return w * h\n')
    files = [tmp_path / "stats.py", tmp_path / "shapes.py"]
    got = completion_problems(10, seed=0, files=files)
    assert len(got) == 2 and all(p.split("\n")[0] in COMPLETION_ASKS for p in got)
    area = next(p for p in got if "def area" in p)
    assert area.endswith('```python\ndef area(w, h):\n    """Return the area of a w by h rectangle."""\n```')
    assert "return w * h" not in area and completion_problems(1, seed=0, files=files) == got[:1]
    assert completion_problems(10, seed=0, files=files[::-1]) == got
