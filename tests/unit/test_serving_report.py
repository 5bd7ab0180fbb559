"""The serving benchmark's pure parts: aggregation over repeats, within-repeat ratios, the table, the parsers."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a folder of scripts, not installed

from benchmarks.serving_report import (TABLE_END, TABLE_START, Cell, Measurement, Stat, accept_length,  # noqa: E402
                                       decode_lines, dspark_verify_length, first_difference, output_identity,
                                       prometheus_totals, ratio, render_identity, render_table,
                                       speculated_share, splice_readme, stat, step_breakdown, summarize,
                                       with_rest_of_step)


def m(total: float, user: float, accept: float | None = None, verify: float | None = None,
      step_ms: dict | None = None) -> Measurement:
    return Measurement(output_throughput=total, per_user_tps=user, ttft_p50_ms=100.0, ttft_p99_ms=200.0,
                       tpot_p50_ms=1000.0 / user, tpot_p99_ms=2000.0 / user, accept_length=accept,
                       verify_length=verify, server_rss_mb=1024.0, step_ms=step_ms or {})


def test_stat_median_min_max_skips_missing():
    assert stat([3.0, 1.0, 2.0]) == Stat(2.0, 1.0, 3.0, 3)
    assert stat([4.0, None, 2.0]) == Stat(3.0, 2.0, 4.0, 2)
    assert stat([None]) is None
    assert stat([]) is None


def test_ratio_needs_both_values():
    assert ratio(6.0, 3.0) == 2.0
    assert ratio(None, 3.0) is None
    assert ratio(6.0, 0.0) is None
    assert ratio(6.0, None) is None


def test_summarize_aggregates_repeats_and_takes_ratios_within_each_repeat():
    # repeat 0: base 10, dspark 20 (2.0x); repeat 1: base 5, dspark 15 (3.0x); repeat 2: base 20, dspark 20 (1.0x).
    # Ratio of medians would be 20/10 = 2.0 by chance; the within-repeat median is also 2.0 but min/max are 1 and 3.
    cells = [Cell("none", "chat", 1, r, m(t, t)) for r, t in enumerate((10.0, 5.0, 20.0))]
    cells += [Cell("dspark", "chat", 1, r, m(t, t, accept=a, verify=3.0)) for r, (t, a) in
              enumerate(((20.0, 2.0), (15.0, 3.0), (20.0, 1.0)))]
    base, dspark = summarize(cells)
    assert (base.config, dspark.config) == ("none", "dspark")
    assert base.stats["output_throughput"] == Stat(10.0, 5.0, 20.0, 3)
    assert "accept_length" not in base.stats
    assert base.ratios["output_throughput"] == Stat(1.0, 1.0, 1.0, 3)
    assert dspark.ratios["output_throughput"] == Stat(2.0, 1.0, 3.0, 3)
    assert dspark.stats["accept_length"] == Stat(2.0, 1.0, 3.0, 3)
    assert dspark.stats["verify_length"] == Stat(3.0, 3.0, 3.0, 3)


def test_summarize_ratio_missing_without_baseline_in_that_repeat():
    cells = [Cell("none", "code", 2, 0, m(10.0, 5.0)), Cell("dspark", "code", 2, 0, m(12.0, 6.0)),
             Cell("dspark", "code", 2, 1, m(30.0, 9.0))]  # repeat 1 has no baseline: no ratio from it
    _, dspark = summarize(cells)
    assert dspark.ratios["per_user_tps"] == Stat(1.2, 1.2, 1.2, 1)
    assert dspark.stats["per_user_tps"].n == 2


def test_summarize_keeps_step_phases():
    cells = [Cell("dspark", "chat", 1, r, m(10.0, 5.0, step_ms={"draft": d, "verify": 30.0, "commit": 1.0}))
             for r, d in enumerate((4.0, 6.0))]
    (s,) = summarize(cells)
    assert s.stats["step_ms.draft"] == Stat(5.0, 4.0, 6.0, 2)


def test_render_table_rows_sorted_by_dataset_then_concurrency_keeping_config_order():
    cells = [Cell("none", "code", 1, 0, m(10.0, 10.0)), Cell("dspark", "code", 1, 0, m(15.0, 15.0, 2.5, 4.0)),
             Cell("none", "chat", 1, 0, m(8.0, 8.0)), Cell("dspark", "chat", 1, 0, m(8.0, 8.0, 1.25, 2.0))]
    lines = render_table(summarize(cells)).splitlines()
    assert lines[0].startswith("| prompts | conc. | config |")
    assert [line.split(" | ")[:3] for line in lines[2:]] == [
        ["| chat", "1", "none"], ["| chat", "1", "dspark"], ["| code", "1", "none"], ["| code", "1", "dspark"]]
    assert lines[5] == ("| code | 1 | dspark | 15.0 | 1.50 | 15.0 | 1.50 | 100 / 200 | 67 / 133 | 2.50 | 4.00 | - "
                        "| 1024 |")
    assert lines[4].split(" | ")[9:11] == ["-", "-"]  # no speculation: no accept / verify length


def test_render_table_shows_spread_over_repeats():
    cells = [Cell("none", "chat", 1, r, m(10.0, 10.0)) for r in range(2)]
    cells += [Cell("dspark", "chat", 1, 0, m(10.0, 12.0)), Cell("dspark", "chat", 1, 1, m(10.0, 16.0))]
    row = render_table(summarize(cells)).splitlines()[3]
    assert row.split(" | ")[4] == "1.40 [1.20-1.60]"


def test_outputs_against_the_baselines_share_identical_and_earliest_difference():
    letters = list  # one token per character
    assert output_identity(["ab", "ac"], ["ab", "ab"], letters) == (0.5, 1)
    assert output_identity(["abc", "xbc", "ab"], ["abc", "abc", "abc"], letters) == (pytest.approx(1 / 3), 0)
    assert output_identity(["ab"], ["ab"], letters) == (1.0, None)
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix differs where it ends
    with pytest.raises(ValueError):
        output_identity(["a"], ["a", "b"], letters)


def test_render_identity_lists_the_configurations_compared():
    from dataclasses import replace

    same, differs = replace(m(10.0, 5.0), same_as_baseline=1.0), replace(m(10.0, 5.0), same_as_baseline=0.75,
                                                                       first_difference=37)
    cells = [Cell("none", "chat", 1, 0, m(10.0, 5.0)), Cell("dspark", "chat", 1, 0, differs),
             Cell("dspark", "chat", 1, 1, same), Cell("ngram", "chat", 1, 0, same)]
    lines = render_identity(summarize(cells)).splitlines()
    assert lines[2:] == ["| chat | 1 | dspark | 0.88 [0.75-1.00] | 37 |", "| chat | 1 | ngram | 1.00 | - |"]
    assert render_identity(summarize(cells[:1])) == ""


def test_splice_readme_replaces_only_between_markers():
    readme = f"# T\n{TABLE_START}\nold\n{TABLE_END}\nafter\n"
    assert splice_readme(readme, "| new |") == f"# T\n{TABLE_START}\n| new |\n{TABLE_END}\nafter\n"
    with pytest.raises(ValueError):
        splice_readme("# no markers\n", "| new |")


PROM_BEFORE = """# HELP sglang:generation_tokens_total x
sglang:generation_tokens_total{model_name="m",is_streaming="true"} 10.0
sglang:generation_tokens_total{model_name="m",is_streaming="false"} 5.0
sglang:spec_verify_calls_total{model_name="m"} 5.0
sglang:dspark_verify_length_sum{model_name="m"} 12.0
sglang:dspark_verify_length_count{model_name="m"} 4.0
"""
PROM_AFTER = PROM_BEFORE.replace("} 10.0", "} 55.0").replace("calls_total{model_name=\"m\"} 5.0",
                                                           "calls_total{model_name=\"m\"} 20.0") \
    .replace("sum{model_name=\"m\"} 12.0", "sum{model_name=\"m\"} 42.0") \
    .replace("count{model_name=\"m\"} 4.0", "count{model_name=\"m\"} 14.0")


def test_prometheus_totals_sum_label_sets():
    assert prometheus_totals(PROM_BEFORE)["sglang:generation_tokens_total"] == 15.0


def test_accept_and_verify_length_from_counter_deltas():
    before, after = prometheus_totals(PROM_BEFORE), prometheus_totals(PROM_AFTER)
    assert accept_length(before, after) == 45.0 / 15.0
    assert dspark_verify_length(before, after) == 30.0 / 10.0
    assert accept_length(before, before) is None


def test_decode_lines_and_step_breakdown_weight_by_steps():
    log = ("[x] DSpark decode: steps=10 accept_len=1.50 draft_ms=4.0 verify_ms=30.0 commit_ms=1.0 draft_failures=0\n"
           "other line\n"
           "[y] DSpark decode: steps=30 accept_len=2.00 draft_ms=8.0 verify_ms=50.0 commit_ms=2.0 draft_failures=0\n")
    lines = decode_lines(log)
    assert [line["steps"] for line in lines] == [10.0, 30.0]
    assert step_breakdown(lines) == {"draft": 7.0, "verify": 45.0, "commit": 1.75}  # lines without between_ms
    assert step_breakdown([]) == {}
    measured = decode_lines("DSpark decode: steps=10 draft_ms=4.0 verify_ms=30.0 commit_ms=1.0 between_ms=3.0\n"
                            "DSpark decode: steps=30 draft_ms=8.0 verify_ms=50.0 commit_ms=2.0 between_ms=7.0\n")
    assert step_breakdown(measured) == {"draft": 7.0, "verify": 45.0, "commit": 1.75, "between": 6.0}
    assert speculated_share(lines) is None  # lines without the gate's field


def test_speculated_share_weights_lines_by_steps():
    lines = decode_lines("DSpark decode: steps=10 speculated=1.00 spec_steps=1.00\n"
                         "DSpark decode: steps=30 speculated=0.20 spec_steps=0.50\n")
    assert speculated_share(lines) == pytest.approx((10 * 1.0 + 30 * 0.2) / 40)


def test_rest_of_step_is_accept_len_times_tpot_minus_phases():
    phases = {"draft": 5.0, "verify": 30.0, "commit": 1.0}
    assert with_rest_of_step(phases, 2.0, 25.0) == {**phases, "rest": 14.0}
    assert with_rest_of_step(phases, 1.0, 20.0)["rest"] == 0.0  # never negative
    assert with_rest_of_step({}, 2.0, 25.0) == {}
    assert with_rest_of_step(phases, None, 25.0) == phases


def test_each_cell_gets_its_own_prompts(tmp_path):
    import json

    from benchmarks.serving import write_prompt_files

    files = write_prompt_files(tmp_path, ["code"], [1, 4], per_cell=2, seed=0, max_chars=1500)
    rows = {key: [json.loads(line) for line in path.read_text().splitlines()] for key, path in files.items()}
    assert sorted(files) == [("code", 1), ("code", 4)]
    assert [len(rows["code", 1]), len(rows["code", 4])] == [2, 4]  # at least the concurrency
    first = {r["conversations"][0]["content"] for r in rows["code", 1]}
    assert not first & {r["conversations"][0]["content"] for r in rows["code", 4]}


def test_rendered_prompt_sets_skip_the_clients_chat_template(tmp_path):
    import argparse

    from benchmarks.serving import RENDERED, bench_args, write_prompt_files

    args = argparse.Namespace(num_prompts=2, output_len=8, context_len=64, model_path="m", seed=0)
    plain = bench_args(args, "http://x", tmp_path / "p.jsonl", 1, tmp_path / "o.jsonl")
    rendered = bench_args(args, "http://x", tmp_path / "p.jsonl", 1, tmp_path / "o.jsonl", rendered=True)
    assert "--apply-chat-template" in plain and "--apply-chat-template" not in rendered
    assert [a for a in plain if a != "--apply-chat-template"] == rendered
    assert "multiturn" in RENDERED and "code" not in RENDERED
    with pytest.raises(SystemExit, match="unknown dataset"):
        write_prompt_files(tmp_path, ["nope"], [1], per_cell=1, seed=0, max_chars=10)
