"""The commands' failure convention: one stderr line naming the cause, exit status 1."""

import pytest

from sgl_dspark import cli


def test_a_clean_run_exits_0(capsys):
    assert cli.run("prog", lambda: None) == 0
    assert capsys.readouterr().err == ""


def test_a_bad_input_is_one_line_and_exit_1(capsys):
    def body():
        raise ValueError("data folder /x has no train.jsonl")

    assert cli.run("sgl_dspark.training.trainer", body) == 1
    assert capsys.readouterr().err == "sgl_dspark.training.trainer: error: data folder /x has no train.jsonl\n"


def test_other_errors_are_not_swallowed():
    with pytest.raises(KeyError):
        cli.run("prog", lambda: {}["missing"])
