"""Distillation data records, resumable answering, splits, and training-side helpers."""

import gzip
import json

import pytest

from sgl_dspark.training.data import (Answers, Question, Record, answer_all, append_answer, assemble, open_partial,
                                      pending, read_partial, read_records, split, token_counts, write_records)
from sgl_dspark.training.prompts import json_array_items
from sgl_dspark.training.init import feature_layers, frequent_tokens
from sgl_dspark.training.rollout import clip_record


def test_json_array_items_stop_at_a_truncated_tail():
    assert list(json_array_items('[{"a": 1}, {"b": 2},\n {"c": "trunc')) == [{"a": 1}, {"b": 2}]
    assert list(json_array_items("[]")) == []


def test_records_round_trip_and_bad_files_name_the_cause(tmp_path):
    records = [Record("stdlib", [1, 2, 3], 0), Record("sharegpt", [4, 5, 6, 7], 2)]
    write_records(tmp_path / "r.jsonl", records)
    assert read_records(tmp_path / "r.jsonl") == records
    (tmp_path / "bad.jsonl").write_text('{"ids": [1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl: not a sgl_dspark.training.data JSONL file"):
        read_records(tmp_path / "bad.jsonl")


def test_split_is_stable_and_complete():
    records = [Record("stdlib", [i, i + 1], 0) for i in range(200)]
    train, held = split(records, 0.1, seed=0)
    assert len(train) + len(held) == 200 and 5 < len(held) < 40
    assert split(records, 0.1, seed=0) == (train, held)


def test_a_rerun_answers_only_the_questions_missing_from_the_partial_file(tmp_path):
    path = tmp_path / "answers.partial.jsonl"
    questions = [Question("math", [1, 2]), Question("code", [3]), Question("sharegpt", [4, 5, 6])]
    with open_partial(path) as f:
        append_answer(f, questions[2], [7, 8], max_new_tokens=4)  # answers arrive out of order
        append_answer(f, questions[0], [9], max_new_tokens=4)
        append_answer(f, Question("math", [1, 2]), [0, 0, 0, 0, 0, 0], max_new_tokens=6)  # another length: ignored
    done = read_partial(path, max_new_tokens=4)
    assert done == {(4, 5, 6): [7, 8], (1, 2): [9]}
    assert pending(questions, done) == [questions[1]]
    assert read_partial(tmp_path / "missing.jsonl", 4) == {}
    kept = tmp_path / "kept.jsonl.gz"  # answers kept in a repository (--answers-from) read the same, gzipped
    kept.write_bytes(gzip.compress(path.read_bytes()))
    assert read_partial(kept, max_new_tokens=4) == done


def test_a_line_cut_by_a_kill_is_skipped_and_the_next_answer_starts_a_new_line(tmp_path):
    path = tmp_path / "answers.partial.jsonl"
    path.write_text('{"source": "code", "prompt_ids": [3], "output_ids": [5], "max_new_tokens": 4}\n'
                    '{"source": "math", "prompt_ids": [1, 2], "outp')
    assert read_partial(path, 4) == {(3,): [5]}
    with open_partial(path) as f:
        append_answer(f, Question("math", [1, 2]), [9], max_new_tokens=4)
    assert read_partial(path, 4) == {(3,): [5], (1, 2): [9]}
    assert json.loads(path.read_text().splitlines()[-1])["source"] == "math"


def test_records_come_out_in_question_order_whatever_the_completion_order():
    questions = [Question("math", [1, 2]), Question("code", [3]), Question("sharegpt", [4])]
    done = {(4,): [8], (1, 2): [9, 9], (3,): [7]}
    assert assemble(questions, done) == [Record("math", [1, 2, 9, 9], 2), Record("code", [3, 7], 1),
                                         Record("sharegpt", [4, 8], 1)]
    assert assemble(questions, {(3,): [7]}) == [Record("code", [3, 7], 1)]


def test_answer_rate_and_token_counts_per_source():
    assert Answers([], 300, 2.0, 0).tokens_per_s == 150.0 and Answers([], 0, 0.0, 5).tokens_per_s is None
    counts = token_counts([Record("code", [1, 2, 3], 1), Record("stdlib", [4, 5], 0)], [Record("math", [6, 7], 1)])
    assert counts["train_code_tokens"] == 2 and counts["train_stdlib_tokens"] == 2
    assert counts["heldout_math_tokens"] == 1 and counts["train_math_tokens"] == 0


def test_clip_record_keeps_the_tail_and_moves_the_answer_start():
    ex = clip_record(Record("sharegpt", list(range(10)), 6), max_len=6)
    assert ex.ids.tolist() == [4, 5, 6, 7, 8, 9] and ex.first_anchor == 2
    assert clip_record(Record("stdlib", [1, 2, 3], 0), 8).first_anchor == 1


def test_frequent_tokens_and_feature_layers():
    assert frequent_tokens([[3, 3, 1], [1, 3, 0]], 2, vocab_size=5).tolist() == [1, 3]
    assert feature_layers(30, 2) == (1, 7, 15, 22, 27)  # the last one enters the first copied layer (28)


def test_replicas_share_the_questions_and_every_answer_reaches_the_sink():
    """Question i goes to server i mod the replicas; each answer is kept with its own question."""
    import threading

    asked, lock = [], threading.Lock()

    def ask(url: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        with lock:
            asked.append((url, prompt[0]))
        return [prompt[0] + 100] * max_new_tokens

    todo = [Question("prompts", [i]) for i in range(7)]
    kept = {}
    tokens = answer_all(["a", "b"], todo, 3, 2, lambda q, ids: kept.__setitem__(q.prompt[0], ids), ask)
    assert tokens == 21 and kept == {i: [i + 100] * 3 for i in range(7)}
    assert sorted(asked) == sorted([("a", i) for i in range(0, 7, 2)] + [("b", i) for i in range(1, 7, 2)])
