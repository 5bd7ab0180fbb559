"""Drafter checkpoint I/O in the DeepSpec / deepseek-ai/dspark_* format: `config.json` + `*.safetensors`, or the
same safetensors xz-compressed (`*.safetensors.xz`, stdlib lzma: the shipped drafters, ~30% smaller, so the tracked
tree fits the 64 MiB a GPU check carries; `xz -dk` gives back the plain file).

Owns reading a drafter folder's config.json (`read_drafter_config`, the one place it is read), name normalisation
(`model.` prefix dropped; the target's `embed_tokens.*` / `lm_head.*` and `rotary_emb.*` ignored), the refusal of
checkpoints that do not fit the target (one-line ValueErrors naming the field), and saving.
Must not build target weights or touch SGLang.
"""

import json
import lzma
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save_file

from sgl_dspark.drafter.config import DrafterConfig, TargetSpec, check_fits_target, parse_drafter_config
from sgl_dspark.drafter.model import DSparkDrafter, TargetWeights, check_draft_vocab

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
XZ = ".xz"  # a compressed weights file: WEIGHTS_FILE + XZ
IGNORED_PREFIXES = ("embed_tokens.", "lm_head.", "rotary_emb.")  # borrowed from the target / recomputed
_INTEGER_WEIGHTS = ("d2t",)


def read_drafter_config(path: str | Path) -> DrafterConfig:
    """The drafter folder's config.json -> the validated record. ValueError names the bad field (malformed JSON is
    one too); OSError when the file cannot be read. Fit to a target is `check_fits_target`, a separate step."""
    return parse_drafter_config(json.loads((Path(path) / CONFIG_FILE).read_text()))


def save_drafter(drafter: DSparkDrafter, path: str | Path) -> Path:
    """Write config.json + model.safetensors into the directory `path` (created if needed)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(drafter.config.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def weight_files(path: Path) -> list[Path]:
    """The folder's weight files: `*.safetensors` and `*.safetensors.xz`."""
    return sorted([*path.glob("*.safetensors"), *path.glob("*.safetensors" + XZ)])


def compress_weights(path: Path) -> Path:
    """Replace the folder's WEIGHTS_FILE by its xz-compressed form (what the shipped drafters hold)."""
    plain = path / WEIGHTS_FILE
    packed = plain.with_name(plain.name + XZ)
    packed.write_bytes(lzma.compress(plain.read_bytes(), preset=9))
    plain.unlink()
    return packed


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's weight files (plain or xz-compressed), names normalised; target-owned names
    dropped."""
    files = weight_files(path)
    if not files:
        raise ValueError(f"weights: no *.safetensors (or *.safetensors.xz) file in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        tensors = load(lzma.decompress(f.read_bytes())) if f.suffix == XZ else load_file(str(f))
        for name, tensor in tensors.items():
            name = name.removeprefix("model.")
            if not name.startswith(IGNORED_PREFIXES):
                out[name] = tensor
    return out


def _short(names: set[str]) -> str:
    listed = sorted(names)
    return ", ".join(listed[:6]) + (f" (+{len(listed) - 6} more)" if len(listed) > 6 else "")


def check_weights(drafter: DSparkDrafter, weights: dict[str, torch.Tensor]) -> None:
    """Refuse missing, unexpected or mis-shaped weights with a one-line message naming them."""
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    missing = expected.keys() - weights.keys()
    conf_missing = {k for k in missing if k.startswith("confidence_head.")}
    if conf_missing:
        raise ValueError(f"confidence_head: enable_confidence_head is true but the checkpoint lacks "
                         f"{_short(conf_missing)} (train the head or set enable_confidence_head false)")
    if missing:
        raise ValueError(f"missing weights: {_short(missing)}")
    extra = weights.keys() - expected.keys()
    if extra:
        raise ValueError(f"unexpected weights: {_short(extra)}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(weights[name].shape)}, expected {shape}")


def load_drafter(path: str | Path, target: TargetSpec, weights: TargetWeights | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> DSparkDrafter:
    """Load a drafter directory unchanged onto `device`, check it fits `target`, attach the target's weights if
    given (borrowed where they are: on `device` they are not copied)."""
    root = Path(path)
    config = read_drafter_config(root)
    check_fits_target(config, target)
    tensors = read_weights(root)
    if not config.enable_confidence_head:  # as the builtin: a disabled head's weights are ignored
        tensors = {k: v for k, v in tensors.items() if not k.startswith("confidence_head.")}
    drafter = DSparkDrafter(config).to(dtype)
    check_weights(drafter, tensors)
    if config.reduced_vocab:
        check_draft_vocab(tensors["d2t"].long() + torch.arange(tensors["d2t"].shape[0]), config.vocab_size)
    tensors = {k: v.long() if k in _INTEGER_WEIGHTS else v.to(dtype) for k, v in tensors.items()}
    drafter.load_state_dict(tensors, strict=True)
    drafter.to(device).eval().requires_grad_(False)
    if weights is not None:
        drafter.attach_target(weights)
    return drafter
