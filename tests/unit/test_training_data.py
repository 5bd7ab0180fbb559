"""Distillation data records, the truncated ShareGPT reader, splits, and training-side helpers."""

import pytest

from sgl_dspark.training.data import Record, json_array_items, read_records, split, write_records
from sgl_dspark.training.trainer import lr_factor
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


def test_clip_record_keeps_the_tail_and_moves_the_answer_start():
    ex = clip_record(Record("sharegpt", list(range(10)), 6), max_len=6)
    assert ex.ids.tolist() == [4, 5, 6, 7, 8, 9] and ex.first_anchor == 2
    assert clip_record(Record("stdlib", [1, 2, 3], 0), 8).first_anchor == 1


def test_frequent_tokens_and_feature_layers():
    assert frequent_tokens([[3, 3, 1], [1, 3, 0]], 2, vocab_size=5).tolist() == [1, 3]
    assert feature_layers(30, 2) == (1, 7, 15, 22, 27)  # the last one enters the first copied layer (28)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    assert lr_factor(0.5, 10) == pytest.approx(0.5)
    assert lr_factor(1.0, 10) == pytest.approx(1.0)
    assert lr_factor(10.0, 10) == pytest.approx(0.1)
