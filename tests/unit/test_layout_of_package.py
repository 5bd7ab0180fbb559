"""The package layout, read from the source with `ast` (nothing is imported; imports inside functions count):
- one seam: no module under sgl_dspark/ imports scheduler_patch, and none reaches SGLang, directly or through the
  project modules it imports (the algorithm, the draft worker and the tools run without SGLang);
- no import loop among the project's modules;
- tools apart from the runtime: nothing the serving path imports (nor what those import) is training,
  calibration-fitting, export, model-preparation, launcher or benchmark code.
Each rule also runs on a small fake tree that breaks it, so the check is seen to fail."""

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sgl_dspark", "scheduler_patch", "attention_backends")  # the project's packages (loops checked)
PROJECT = (*PACKAGES, "benchmarks")  # import edges followed
TOOLING = ("sgl_dspark.training", "sgl_dspark.tools", "benchmarks")  # packages the runtime must not reach
RUNTIME_PACKAGES = ("scheduler_patch", "attention_backends", "sgl_dspark/draft_worker")
CORE, SEAM, UPSTREAM = "sgl_dspark", "scheduler_patch", "sglang"
# sgl_dspark modules allowed to import SGLang, each with its written reason. None: all of it is in scheduler_patch/.
SGLANG_EXCEPTIONS: dict[str, str] = {
    "sgl_dspark.engine": "the seed article's offline API wraps sglang.Engine; only `from sgl_dspark import "
                         "DSparkEngine` loads it (sgl_dspark.__getattr__), never the serving path",
}


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


def import_statements(source: str, name: str, is_package: bool) -> list[tuple[str, tuple[str, ...]]]:
    """(module, imported names) per import in `source` (the module `name`): top level, in functions, under `if`,
    relative ones resolved; names is () for `import m`. Example: `from .b import c` in a.x -> [("a.b", ("c",))].
    A package's module-level `__getattr__` (PEP 562) is not counted: it runs only when a caller names one of its
    attributes (sgl_dspark's offline API; test_the_offline_api_stays_off_the_serving_path checks it at run time)."""
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(source)
    lazy = {id(n) for f in tree.body if is_package and isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
            for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            out.append((base, tuple(alias.name for alias in node.names)))
    return out


def imported_names(source: str, name: str, is_package: bool) -> set[str]:
    """Every module `source` (the module `name`) may import, the packages each one runs first included;
    `from m import x` counts `m` and, where x is a submodule, `m.x` (the caller drops what is not one)."""
    out: set[str] = set()
    for module, names in import_statements(source, name, is_package):
        out.update(with_parents(module))
        out.update(f"{module}.{n}" for n in names)
    return out


def named_modules(name: str, root: Path = ROOT) -> set[str]:
    """The modules `name`'s imports name, one per imported thing: `import a.b` -> a.b; `from a import b` -> a.b where
    that is a module under `root`, else a (b is read from a's namespace). Other packages' modules are kept as named.
    Running a package's __init__ before its submodule is not counted (it is how Python imports, not a dependency)."""
    path = module_file(name, root)
    out: set[str] = set()
    for module, names in import_statements(path.read_text(), name, path.name == "__init__.py"):
        submodules = {f"{module}.{n}" for n in names if module_file(f"{module}.{n}", root) is not None}
        out |= submodules
        if len(submodules) < len(names) or not names:
            out.add(module)
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
    return any(is_in(name, t) for t in TOOLING)


def tooling_reached(roots: list[str], root: Path = ROOT) -> list[str]:
    parent = reachable(roots, root)
    return [chain(parent, n) for n in sorted(parent) if is_tooling(n)]


def modules_in(package: str, root: Path = ROOT) -> list[str]:
    """Every module under the folder `package` ("a" or "a/b"), packages included."""
    return [module_name(p, root) for p in sorted((root / package).rglob("*.py"))]


def runtime_roots() -> list[str]:
    return [m for package in RUNTIME_PACKAGES for m in modules_in(package)]


def is_in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# -- one seam ---------------------------------------------------------------------------------------------------

def seam_imports(root: Path = ROOT) -> list[str]:
    """'core module imports scheduler_patch...' for each import of the seam under sgl_dspark/."""
    return [f"{m} imports {t}" for m in modules_in(CORE, root) for t in sorted(named_modules(m, root))
            if is_in(t, SEAM)]


def upstream_reached(root: Path = ROOT, allowed: dict[str, str] = SGLANG_EXCEPTIONS) -> list[str]:
    """'module <- importer <- ... <- core module' for each module that imports SGLang and that a core module
    imports, directly or through project modules (itself included); modules in `allowed` are skipped."""
    parent = reachable([m for m in modules_in(CORE, root) if m not in allowed], root)
    return [chain(parent, m) for m in sorted(parent)
            if m not in allowed and any(is_in(t, UPSTREAM) for t in named_modules(m, root))]


# -- no import loops --------------------------------------------------------------------------------------------

def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it names in its imports (itself excluded)."""
    names = {m for package in packages for m in modules_in(package, root)}
    return {m: {t for t in named_modules(m, root) if t in names and t != m} for m in sorted(names)}


def groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected groups (Tarjan): modules that import each other, directly or round a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = {stack.pop()}
            while v not in group:
                group.add(stack.pop())
            out.append(group)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def loop_through(start: str, graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest import loop from `start` back to it inside `group`. Example: a -> b -> a."""
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & group):
            if nxt == start:
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is in no loop of {sorted(group)}")


def import_loops(graph: dict[str, set[str]]) -> list[str]:
    """One loop per group of modules that import each other: 'a -> b -> a'."""
    return [" -> ".join(loop_through(min(g), graph, g)) for g in groups(graph) if len(g) > 1]


def test_the_serving_path_imports_no_tooling():
    reached = tooling_reached(runtime_roots())
    assert not reached, "runtime imports tooling (module <- importer <- ... <- runtime root):\n" + "\n".join(reached)


def test_the_walk_follows_lazy_and_transitive_imports():
    """Guards the check itself: the serving path must be seen to reach modules it imports only indirectly."""
    parent = reachable(runtime_roots())
    assert {"sgl_dspark.budget", "sgl_dspark.verify", "sgl_dspark.drafter.checkpoint",
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


def test_no_core_module_imports_the_seam():
    found = seam_imports()
    assert not found, "sgl_dspark/ must not import scheduler_patch (pass what it needs in from the seam):\n" + \
        "\n".join(found)


def test_the_core_reaches_no_sglang():
    found = upstream_reached()
    assert not found, ("sgl_dspark/ must run without SGLang; these imports reach it (module <- importer <- ... <- "
                       "core module):\n" + "\n".join(found))


def test_every_sglang_exception_names_a_module_and_a_reason():
    for name, reason in SGLANG_EXCEPTIONS.items():
        assert is_in(name, CORE) and module_file(name) is not None and reason.strip(), name


def test_no_import_loops():
    loops = import_loops(import_graph())
    assert not loops, "import loops among the project's modules (lazy imports included):\n" + "\n".join(loops)


def test_the_graph_sees_lazy_imports_and_the_seam_sees_sglang():
    """Guards the checks themselves on the real tree: a function-level import is an edge, and the seam's worker is
    seen to import SGLang (the rule would fire if it lived under sgl_dspark/)."""
    assert "scheduler_patch.runtime.worker" in import_graph()["scheduler_patch.algorithm"]  # inside _worker_class
    assert any(is_in(t, UPSTREAM) for t in named_modules("scheduler_patch.runtime.worker"))
    assert "scheduler_patch.runtime.worker" in reachable(["scheduler_patch.plugin"])


def fake_tree(root: Path, files: dict[str, str]) -> Path:
    """Write `files` (module name -> source) under root, each package with an __init__.py (empty unless given)."""
    for name, source in files.items():
        path = root.joinpath(*name.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for package in path.relative_to(root).parents:
            if package != Path(".") and not (root / package / "__init__.py").exists():
                (root / package / "__init__.py").write_text("")
        path.write_text(source)
    return root


CLEAN = {"sgl_dspark.core": "import torch\nfrom sgl_dspark import helper\n", "sgl_dspark.helper": "import os\n",
         "scheduler_patch.seam": "import sglang\nfrom sgl_dspark.core import x\n",
         "attention_backends.shell": "from sglang.srt.layers import radix_attention\n"}


def test_a_clean_fake_tree_passes(tmp_path):
    root = fake_tree(tmp_path, CLEAN)
    assert seam_imports(root) == [] and upstream_reached(root) == [] and import_loops(import_graph(root)) == []


@pytest.mark.parametrize("line", [
    "import scheduler_patch.seam",
    "from scheduler_patch import seam",
    "from scheduler_patch.seam import launch_of",
    "def later():\n    from scheduler_patch.seam import launch_of\n",
])
def test_a_core_import_of_the_seam_is_caught(tmp_path, line):
    root = fake_tree(tmp_path, {**CLEAN, "sgl_dspark.helper": "import os\n" + line + "\n"})
    assert seam_imports(root) and seam_imports(root)[0].startswith("sgl_dspark.helper imports scheduler_patch")


@pytest.mark.parametrize("line, found", [
    ("import sglang", "sgl_dspark.helper"),
    ("from sglang.srt.managers.utils import GenerationBatchResult", "sgl_dspark.helper"),
    ("def later():\n    import sglang.srt.layers\n", "sgl_dspark.helper"),
    ("from attention_backends import shell", "attention_backends.shell <- sgl_dspark.helper"),  # through the project
])
def test_sglang_reached_from_the_core_is_caught(tmp_path, line, found):
    root = fake_tree(tmp_path, {**CLEAN, "sgl_dspark.helper": "import os\n" + line + "\n"})
    assert upstream_reached(root) == [found]


def test_a_listed_exception_may_import_sglang(tmp_path):
    root = fake_tree(tmp_path, {**CLEAN, "sgl_dspark.helper": "import sglang\n"})
    assert upstream_reached(root, allowed={"sgl_dspark.helper": "a written reason"}) == []


@pytest.mark.parametrize("files, loop", [
    ({"sgl_dspark.a": "from sgl_dspark import b\n", "sgl_dspark.b": "import sgl_dspark.a\n"},
     "sgl_dspark.a -> sgl_dspark.b -> sgl_dspark.a"),
    ({"sgl_dspark.a": "from sgl_dspark.b import x\n", "sgl_dspark.b": "def f():\n    from .c import y\n",
      "sgl_dspark.c": "def g():\n    from sgl_dspark.a import z\n"},
     "sgl_dspark.a -> sgl_dspark.b -> sgl_dspark.c -> sgl_dspark.a"),
    ({"scheduler_patch.algorithm": "def worker():\n    from sgl_dspark.worker import W\n",
      "sgl_dspark.worker": "def setup():\n    from scheduler_patch.server_args import launch_of\n",
      "scheduler_patch.server_args": "from scheduler_patch.algorithm import NAME\n"},
     "scheduler_patch.algorithm -> sgl_dspark.worker -> scheduler_patch.server_args -> scheduler_patch.algorithm"),
    ({"sgl_dspark.pkg.__init__": "from sgl_dspark.pkg.m import X\n",
      "sgl_dspark.pkg.m": "from sgl_dspark.pkg import Y\n"},
     "sgl_dspark.pkg -> sgl_dspark.pkg.m -> sgl_dspark.pkg"),
])
def test_an_import_loop_is_caught(tmp_path, files, loop):
    assert import_loops(import_graph(fake_tree(tmp_path, {**CLEAN, **files}))) == [loop]


def test_a_package_running_before_its_submodule_is_no_loop(tmp_path):
    """pkg/__init__ imports pkg.m, which imports its sibling pkg.n: Python runs pkg first, but nothing loops."""
    files = {"sgl_dspark.pkg.__init__": "from sgl_dspark.pkg.m import X\n", "sgl_dspark.pkg.m": "from .n import Y\n",
             "sgl_dspark.pkg.n": "Y = 1\n"}
    assert import_loops(import_graph(fake_tree(tmp_path, {**CLEAN, **files}))) == []


def test_the_offline_api_stays_off_the_serving_path():
    """The lazy export really is lazy: importing the package, the seam's plugin and launch record, and the draft
    worker loads neither the offline API nor SGLang's engine; naming `sgl_dspark.DSparkEngine` loads it."""
    import subprocess
    import sys

    code = ("import sys, sgl_dspark, scheduler_patch.plugin, scheduler_patch.launch, sgl_dspark.draft_worker.process\n"
            "assert 'sgl_dspark.engine' not in sys.modules, 'loaded early'\n"
            "from sgl_dspark import DSparkConfig, DSparkEngine\n"
            "assert sys.modules['sgl_dspark.engine'].DSparkEngine is DSparkEngine\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
