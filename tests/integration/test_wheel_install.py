"""A real package: the wheel built from this checkout, installed non-editable into a folder outside it, serves DSPARK
with the flags a user types (presets and the shipped drafter come from the installed package, not the checkout),
greedy-identical to the plain server."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import dspark_spec, generate
from sgl_dspark.tools.launch import serving

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def is_prime(n):\n"
GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """site/: the wheel's files (sgl_dspark, scheduler_patch, attention_backends, its dist-info and entry point)."""
    work = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"), str(ROOT)],
                   check=True, cwd=work)
    wheel = next((work / "dist").glob("sgl_dspark-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(work / "site"), str(wheel)],
                   check=True, cwd=work)
    return work / "site"


def test_the_wheel_carries_presets_and_the_drafter(installed):
    assert (installed / "sgl_dspark" / "configs" / "default.json").is_file()
    assert (installed / "sgl_dspark" / "configs" / "tree.json").is_file()
    assert (installed / "sgl_dspark" / "drafters" / "smollm2-135m-instruct" / "config.json").is_file()
    assert (installed / "sgl_dspark" / "drafters" / "smollm2-135m-instruct" / "recommended.json").is_file()
    assert any(installed.glob("sgl_dspark-*.dist-info/entry_points.txt"))


def test_the_installed_wheel_serves_dspark(installed, default_model_path, plain_server, tmp_path_factory):
    drafter = installed / "sgl_dspark" / "drafters" / "smollm2-135m-instruct"
    spec = dspark_spec(default_model_path, str(drafter), "--speculative-dspark-preset", "tree")
    spec = dataclasses.replace(spec, env={"PYTHONPATH": str(installed)}, cwd=str(installed.parent))
    with serving(spec, tmp_path_factory.mktemp("wheel-server")) as server:
        out = generate(server.base_url, PROMPT, **GREEDY)
        log = server.log_text()
    assert f"from={installed / 'sgl_dspark'}" in log  # the plugin ran from the installed wheel
    assert "lookup=True" in log  # the drafter's recommended.json applies under the preset
    assert out["output_ids"] == generate(plain_server.base_url, PROMPT, **GREEDY)["output_ids"]
    assert out["meta_info"]["spec_verify_ct"] > 0
