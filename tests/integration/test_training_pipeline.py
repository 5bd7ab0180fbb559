"""The drafter-training pipeline end to end on a tiny budget: data through the real server, train, resume,
calibrate, export; the exported drafter loads for the default model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_dspark.training.data import read_records
from conftest import generate

pytestmark = pytest.mark.integration

QUESTIONS = ["What is a prime number?", "Name three colours.", "Write a haiku about the sea."]


def run(module: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def data_dir(default_model_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    questions = out / "questions.txt"
    questions.write_text("\n".join(QUESTIONS) + "\n")
    run("sgl_dspark.training.data", "build", "--out", str(out), "--model-path", default_model_path, "--prompts-file",
        str(questions), "--sharegpt-prompts", "0", "--max-new-tokens", "16", "--stdlib-tokens", "3000",
        "--heldout-share", "0.5", "--concurrency", "3", "--replicas", "1", "--port", "0")
    return out


def test_answers_are_the_target_greedy_output(data_dir, plain_server, default_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    records = read_records(data_dir / "train.jsonl") + read_records(data_dir / "heldout.jsonl")
    answers = [r for r in records if r.source == "prompts"]
    assert len(answers) == len(QUESTIONS) and any(r.source == "stdlib" for r in records)
    for r in answers:
        prompt = tok.decode(r.ids[:r.loss_from])
        plain = generate(plain_server.base_url, prompt, temperature=0, max_new_tokens=16)["output_ids"]
        assert r.ids[r.loss_from:] == plain


def test_train_resume_calibrate_export(data_dir, default_model_path, tmp_path):
    from sgl_dspark.drafter.checkpoint import load_drafter
    from sgl_dspark.drafter.config import TargetSpec

    run_dir = tmp_path / "run"
    common = ["--data", str(data_dir), "--out", str(run_dir), "--target", default_model_path, "--preset", "tiny",
              "--eval-records", "2", "--anchors", "16"]
    ideas = ("--markov-init", "bigram", "--complement", "0.5", "--top-k", "8")  # issue 13's ideas, on real data
    built = run("sgl_dspark.training.trainer", *common, "--minutes", "0.05", *ideas)
    assert "Markov head from the training data's bigram PMI" in built
    assert json.loads(run_dir.joinpath("run.json").read_text())["complement"] == 0.5
    first = json.loads(run_dir.joinpath("curve.jsonl").read_text().splitlines()[-1])
    run("sgl_dspark.training.trainer", *common, "--minutes", "0.1")  # resumes: same folder, larger budget
    curve = [json.loads(line) for line in run_dir.joinpath("curve.jsonl").read_text().splitlines()]
    assert curve[-1]["step"] > first["step"] >= 1 and 1.0 <= curve[-1]["tau"] <= 8.0
    assert curve[-1]["tau"] <= curve[-1]["tau_hybrid"] <= 8.0  # the lookup chain can only add
    assert len(curve[-1]["cond_accept"]) == 7
    run("sgl_dspark.training.calibrate", "--drafter", str(run_dir / "checkpoint"), "--data", str(data_dir),
        "--target", default_model_path, "--records", "2")
    fitted = json.loads((run_dir / "checkpoint" / "calibration.json").read_text())
    assert len(fitted["temperatures"]) == len(fitted["biases"]) == 7 and all(t > 0 for t in fitted["temperatures"])
    assert (run_dir / "checkpoint" / "reliability.png").stat().st_size > 0
    out = tmp_path / "shipped"
    run("sgl_dspark.training.export", "--run", str(run_dir), "--data", str(data_dir), "--out", str(out))
    target = TargetSpec.from_hf_config(json.loads(Path(default_model_path, "config.json").read_text()))
    assert load_drafter(out, target).config.gamma == 7
    assert "Held-out accepted length" in (out / "README.md").read_text()
    assert (out / "calibration.json").is_file() and (out / "reliability.png").is_file()
    state = json.loads((out / "training_state.json").read_text())
    assert (state["steps"], state["minutes"]) == (curve[-1]["step"], curve[-1]["minutes"])
    # a long run continues elsewhere from the exported folder alone: the curve goes on from its steps and minutes
    more = tmp_path / "continued"
    run("sgl_dspark.training.trainer", "--target", default_model_path, "--data", str(data_dir), "--out", str(more),
        "--preset", "tiny", "--eval-records", "2", "--anchors", "16", "--minutes", "0.05", "--init-from", str(out))
    rows = [json.loads(line) for line in more.joinpath("curve.jsonl").read_text().splitlines()]
    assert rows[:len(curve)] == curve and rows[-1]["step"] > state["steps"] and rows[-1]["minutes"] > state["minutes"]


def test_bad_data_folder_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sgl_dspark.training.trainer", "--data", str(tmp_path), "--out",
                           str(tmp_path / "r"), "--minutes", "0.01"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("sgl_dspark.training.trainer: error: training data")
