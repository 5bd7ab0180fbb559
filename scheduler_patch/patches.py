"""Named AROUND patches on upstream symbols: the only way this plugin changes SGLang's code.

A `Patch` names one dotted upstream symbol, states what it must look like (kind, parameter names, other upstream
facts it relies on) and wraps it: the replacement calls `around(original, *args, **kwargs)`. `apply` is idempotent
and keeps the original; `undo` restores it (tests). A symbol that is missing or looks different raises
`PatchDriftError` naming it, so SGLang drift fails at plugin load, not mid-request. Holds no DSpark logic.
"""

import functools
import inspect
import pkgutil
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

KINDS = ("function", "method", "classmethod", "staticmethod", "class")  # "class": a class attribute holding a
# class that upstream instantiates through the attribute (e.g. `self.server_args_class(**kwargs)`)


class PatchDriftError(RuntimeError):
    """An upstream symbol a patch needs is missing or no longer looks as the patch expects."""


@dataclass
class Patch:
    name: str  # e.g. "dspark.from_string"
    target: str  # dotted upstream symbol, e.g. "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.from_string"
    kind: str  # one of KINDS ("function": a module attribute)
    params: tuple[str, ...] | None  # the original's parameter names, cls/self included; None: not checked
    around: Callable[..., Any]  # around(original, *args, **kwargs) -> result
    requires: Callable[[], str | None] | None = None  # other upstream facts the patch relies on: None or what drifted
    _original: Any = field(default=None, init=False, repr=False)  # the raw attribute as found (descriptor kept)
    _installed: Any = field(default=None, init=False, repr=False)

    @property
    def applied(self) -> bool:
        return self._installed is not None and self._raw() is self._installed

    def check(self) -> Any:
        """The raw upstream attribute, or PatchDriftError if it is missing or does not look as expected."""
        if self.applied:
            return self._original
        raw = self._raw()
        kind, func = _kind_of(self._owner(), raw)
        if kind != self.kind:
            raise self._drift(f"is a {kind}, expected a {self.kind}")
        if self.params is not None:
            found = _param_names(func)
            if found != self.params:
                raise self._drift(f"has parameters {found}, expected {self.params}")
        problem = self.requires() if self.requires is not None else None
        if problem:
            raise PatchDriftError(f"patch {self.name}: {problem}; the pinned SGLang version changed")
        return raw

    def apply(self) -> None:
        if self.applied:
            return
        raw = self.check()
        installed = _wrap(self.kind, raw, self.around)
        setattr(self._owner(), self._attr, installed)
        self._original, self._installed = raw, installed

    def undo(self) -> None:
        if self._installed is None:
            return
        if not self.applied:
            raise PatchDriftError(f"patch {self.name}: {self.target} was replaced after it was "
                                  f"patched; cannot restore the original")
        setattr(self._owner(), self._attr, self._original)
        self._original = self._installed = None

    @property
    def _attr(self) -> str:
        return self.target.rsplit(".", 1)[1]

    def _owner(self) -> Any:
        path = self.target.rsplit(".", 1)[0]
        try:
            return pkgutil.resolve_name(path)
        except (ImportError, AttributeError, ValueError) as e:
            raise self._drift(f"cannot be resolved ({path}: {e})") from None

    def _raw(self) -> Any:
        owner = self._owner()
        raw = vars(owner).get(self._attr, _MISSING)
        if raw is _MISSING:
            raise self._drift("is missing")
        return raw

    def _drift(self, what: str) -> PatchDriftError:
        return PatchDriftError(f"patch {self.name}: upstream {self.target} {what}; "
                               f"the pinned SGLang version changed")


_MISSING = object()


def _kind_of(owner: Any, raw: Any) -> tuple[str, Callable | None]:
    if isinstance(raw, classmethod):
        return "classmethod", raw.__func__
    if isinstance(raw, staticmethod):
        return "staticmethod", raw.__func__
    if isinstance(owner, type) and isinstance(raw, type):
        return "class", None
    if isinstance(owner, type):
        return ("method", raw) if inspect.isfunction(raw) else (type(raw).__name__, None)
    if callable(raw) and not isinstance(raw, type):
        return "function", raw
    return type(raw).__name__, None


def _param_names(func: Callable) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None


def _wrap(kind: str, raw: Any, around: Callable) -> Any:
    """The replacement attribute: same descriptor kind as `raw`, calling `around(original, ...)`."""
    if kind == "classmethod":
        func = raw.__func__

        @functools.wraps(func)
        def bound(cls, *args, **kwargs):
            return around(types.MethodType(func, cls), *args, **kwargs)

        return classmethod(bound)
    func = raw.__func__ if kind == "staticmethod" else raw

    def wrapper(*args, **kwargs):
        return around(func, *args, **kwargs)

    if kind == "class":  # called through an instance: no self
        wrapper.__name__ = wrapper.__qualname__ = f"{raw.__name__}_patched"
        return staticmethod(wrapper)
    wrapper = functools.wraps(func)(wrapper)
    return staticmethod(wrapper) if kind == "staticmethod" else wrapper


def source_lacks(target: str, snippets: tuple[str, ...]) -> str | None:
    """For a `requires=` check: which upstream source snippets (whitespace-normalised) `target` no longer holds."""
    source = " ".join(inspect.getsource(pkgutil.resolve_name(target)).split())
    missing = [s for s in snippets if s not in source]
    return f"{target} no longer contains {missing}" if missing else None


def apply_all(patches: Iterable[Patch]) -> None:
    """Check every patch first, then apply them all: SGLang drift leaves nothing half-patched."""
    patches = list(patches)
    for patch in patches:
        patch.check()
    for patch in patches:
        patch.apply()


def undo_all(patches: Iterable[Patch]) -> None:
    for patch in reversed(list(patches)):
        patch.undo()
