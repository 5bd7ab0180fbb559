"""Patch: the plugin's attention backends, registered in SGLang's attention registry and CLI choices.

Registers the names "dspark_torch" (CPU reference, tree verification) and "dspark_flashinfer" (GPU). Idempotent,
undoable (`unregister_attention_backends`), and checks each upstream symbol before touching it, so SGLang
drift fails loudly at plugin load. Backend modules are imported only when SGLang builds a backend.
"""

import importlib
from collections.abc import Callable

from attention_backends import FLASHINFER_BACKEND, TORCH_BACKEND

from scheduler_patch.errors import StartupError

REGISTRY_MODULE = "sglang.srt.layers.attention.attention_registry"
CHOICES_MODULE = "sglang.srt.arg_groups.choices"


def create_torch_backend(runner):
    from attention_backends.reference import TreeTorchNativeAttnBackend

    return TreeTorchNativeAttnBackend(runner)


def create_flashinfer_backend(runner):
    """The FlashInfer tree-verify backend, or a StartupError (one line) for a model or server it cannot serve."""
    from attention_backends.flashinfer_backend import FlashInferTreeAttnBackend
    from attention_backends.layers import VerifyRefusal

    try:
        return FlashInferTreeAttnBackend(runner)
    except VerifyRefusal as e:
        raise StartupError(str(e)) from e


FACTORIES: dict[str, Callable] = {TORCH_BACKEND: create_torch_backend, FLASHINFER_BACKEND: create_flashinfer_backend}


def _upstream(module_name: str, symbol: str, check: Callable[[object], bool], expected: str):
    """module_name.symbol, or a RuntimeError naming it when it is missing or not `expected`."""
    value = getattr(importlib.import_module(module_name), symbol, None)
    if value is None or not check(value):
        raise RuntimeError(f"sgl-dspark: {module_name}.{symbol} is missing or not {expected} "
                           f"(got {type(value).__name__}); the pinned SGLang version changed")
    return value


def _registry() -> dict:
    _upstream(REGISTRY_MODULE, "register_attention_backend", callable, "a decorator factory")
    return _upstream(REGISTRY_MODULE, "ATTENTION_BACKENDS", lambda v: isinstance(v, dict), "a dict name -> factory")


def _choice_lists() -> list[tuple[list, Callable]]:
    """(ATTENTION_BACKEND_CHOICES, add_attention_backend_choices) and the draft pair, after checking that each
    public add_*_choices helper still extends exactly its list (argparse holds the lists by reference)."""
    pairs = []
    for choices, adder in (("ATTENTION_BACKEND_CHOICES", "add_attention_backend_choices"),
                           ("DRAFT_ATTENTION_BACKEND_CHOICES", "add_draft_attention_backend_choices")):
        names = _upstream(CHOICES_MODULE, choices, lambda v: isinstance(v, list), "a list of names")
        add = _upstream(CHOICES_MODULE, adder, lambda v, names=names: getattr(v, "__self__", None) is names,
                        f"{choices}.extend")
        pairs.append((names, add))
    return pairs


def register_attention_backends() -> None:
    """Make --attention-backend and --speculative-draft-attention-backend accept the plugin's names."""
    register = importlib.import_module(REGISTRY_MODULE).register_attention_backend
    registry = _registry()
    choice_lists = _choice_lists()
    for name, factory in FACTORIES.items():
        if registry.get(name) is not factory:
            register(name)(factory)
        for names, add in choice_lists:
            if name not in names:
                add([name])


def unregister_attention_backends() -> None:
    """Undo `register_attention_backends` (tests)."""
    registry = _registry()
    choice_lists = _choice_lists()
    for name in FACTORIES:
        registry.pop(name, None)
        for names, _ in choice_lists:
            if name in names:
                names.remove(name)
