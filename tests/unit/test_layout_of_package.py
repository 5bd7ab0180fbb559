"""Tools apart from the runtime: nothing the serving path imports (imports inside functions count, and so do the
imports of what it imports) is training, calibration-fitting, export, model-preparation, launcher or benchmark code.
Read from the source with `ast`; nothing is imported."""

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("sgl_dspark", "scheduler_patch", "attention_backends", "benchmarks")  # import edges followed
TOOLING = ("sgl_dspark.training", "sgl_dspark.tools", "benchmarks")  # packages the runtime must not reach
RUNTIME_PACKAGES = ("scheduler_patch", "attention_backends", "sgl_dspark/draft_worker")
RUNTIME_MODULES = ("sgl_dspark.worker", "sgl_dspark.serving", "sgl_dspark.scheduler", "sgl_dspark.verify")


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """`a.b.c` -> root/a/b/c.py or root/a/b/c/__init__.py; None if neither exists."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def with_parents(name: str) -> list[str]:
    """Importing `a.b.c` runs `a` and `a.b` first. Example: "a.b.c" -> ["a", "a.b", "a.b.c"]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imported_names(source: str, name: str, is_package: bool) -> set[str]:
    """Every module `source` (the module `name`) may import: top level, in functions, under `if`, relative ones
    resolved; `from m import x` counts `m` and, where x is a submodule, `m.x` (the caller drops what is not one)."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.update(with_parents(alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            out.update(with_parents(base))
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def project_imports(name: str, root: Path = ROOT) -> set[str]:
    """The project modules (files that exist under `root`) the module `name` imports directly."""
    path = module_file(name, root)
    names = imported_names(path.read_text(), name, path.name == "__init__.py")
    return {n for n in names if n.split(".")[0] in PROJECT and module_file(n, root) is not None}


def reachable(roots: list[str], root: Path = ROOT) -> dict[str, str | None]:
    """Breadth-first over import edges: module -> the module that first imported it (None for a root)."""
    parent: dict[str, str | None] = dict.fromkeys(roots)
    queue = deque(roots)
    while queue:
        current = queue.popleft()
        for imported in sorted(project_imports(current, root)):
            if imported not in parent:
                parent[imported] = current
                queue.append(imported)
    return parent


def chain(parent: dict[str, str | None], name: str) -> str:
    links = [name]
    while parent[links[-1]] is not None:
        links.append(parent[links[-1]])
    return " <- ".join(links)


def is_tooling(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TOOLING)


def tooling_reached(roots: list[str], root: Path = ROOT) -> list[str]:
    parent = reachable(roots, root)
    return [chain(parent, n) for n in sorted(parent) if is_tooling(n)]


def runtime_roots() -> list[str]:
    files = [p for package in RUNTIME_PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    modules = [module_name(p) for p in files]
    # worker and serving move under scheduler_patch/ (issue 15): wherever they live, they are runtime
    return modules + [m for m in RUNTIME_MODULES if module_file(m) is not None]


def test_the_serving_path_imports_no_tooling():
    reached = tooling_reached(runtime_roots())
    assert not reached, "runtime imports tooling (module <- importer <- ... <- runtime root):\n" + "\n".join(reached)


def test_the_walk_follows_lazy_and_transitive_imports():
    """Guards the check itself: the serving path must be seen to reach modules it imports only indirectly."""
    parent = reachable(runtime_roots())
    assert {"sgl_dspark.scheduler", "sgl_dspark.verify", "sgl_dspark.drafter.checkpoint",
            "sgl_dspark.drafter.config"} <= parent.keys()


def test_the_moved_tools_exist_where_the_check_looks():
    for name in ("sgl_dspark.training.trainer", "sgl_dspark.training.calibrate", "sgl_dspark.training.data",
                 "sgl_dspark.training.export", "sgl_dspark.tools.demo", "sgl_dspark.tools.models",
                 "sgl_dspark.tools.launch", "benchmarks.acceptance_report"):
        assert module_file(name) is not None and is_tooling(name), name


@pytest.mark.parametrize("line", [
    "from sgl_dspark.tools.launch import serving",
    "import sgl_dspark.training.trainer",
    "from sgl_dspark.training import export",
    "from .tools import models",
    "def later():\n    from sgl_dspark.tools.models import prepare\n",
])
def test_a_tooling_import_in_a_runtime_module_is_caught(tmp_path, line):
    """The same walk over a tiny fake tree: runtime `sgl_dspark.core.step` -> `sgl_dspark.helper` -> tooling."""
    for pkg in ("sgl_dspark", "sgl_dspark/core", "sgl_dspark/tools", "sgl_dspark/training"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    for mod in ("tools/launch", "tools/models", "training/trainer", "training/export"):
        (tmp_path / "sgl_dspark" / f"{mod}.py").write_text("")
    (tmp_path / "sgl_dspark" / "core" / "step.py").write_text("from sgl_dspark import helper\n")
    (tmp_path / "sgl_dspark" / "helper.py").write_text("import os\n")
    assert tooling_reached(["sgl_dspark.core.step"], tmp_path) == []
    (tmp_path / "sgl_dspark" / "helper.py").write_text("import os\n" + line + "\n")
    assert tooling_reached(["sgl_dspark.core.step"], tmp_path)[0].endswith("sgl_dspark.helper <- sgl_dspark.core.step")
