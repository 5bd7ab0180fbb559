"""benchmarks/greedy_identity.py's comparison: where an output first differs from plain's, plain's top-two gap
there, whether the other token was plain's second choice, and the table's counts."""

from benchmarks.greedy_identity import Prompt, differences, render


def reply(ids: list[int], tops: list[list[tuple[float, int]]] | None = None) -> dict:
    return {"output_ids": ids, "meta_info": {"output_top_logprobs": [[(lp, i, "") for lp, i in t] for t in tops or []]}}


PLAIN = [reply([5, 6, 7], [[(-0.1, 5), (-3.0, 9)], [(-0.5, 6), (-0.6, 8)], [(-0.2, 7), (-2.0, 1)]]),
         reply([1, 2], [[(-0.1, 1), (-2.1, 3)], [(-0.3, 2), (-0.3, 4)]])]
PROMPTS = [Prompt("a", "x"), Prompt("b", "y")]


def test_a_difference_names_its_first_token_plains_gap_and_whether_it_took_plains_second_choice():
    found = differences("run", PROMPTS, [reply([5, 8, 7]), reply([1, 2])], PLAIN)
    assert len(found) == 1
    d = found[0]
    assert (d.set, d.prompt, d.at, d.second_choice) == ("a", 0, 1, True)
    assert abs(d.plain_gap - 0.1) < 1e-9


def test_a_token_outside_plains_top_two_is_not_its_second_choice_and_a_missing_report_has_no_gap():
    found = differences("run", PROMPTS, [reply([5, 6, 7]), reply([1, 9])], PLAIN)
    assert [(d.at, d.second_choice, d.plain_gap) for d in found] == [(1, False, 0.0)]
    bare = differences("run", PROMPTS[:1], [reply([4, 6, 7])], [reply([5, 6, 7])])
    assert [(d.at, d.plain_gap) for d in bare] == [(0, None)]


def test_the_table_counts_identical_outputs_per_set():
    found = differences("run", PROMPTS, [reply([5, 8, 7]), reply([1, 2])], PLAIN)
    table = render(PROMPTS, found, ["run", "other"])
    assert "| run | 0/1 | 1/1 | 1/2 | 1 | median 0.1000, max 0.1000 |" in table
    assert "| other | 1/1 | 1/1 | 2/2 | - | - |" in table
