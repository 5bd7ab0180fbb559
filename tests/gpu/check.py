"""`make gpu-check`: tests/gpu on a GPU machine without network access, with the pack `make gpu-pack` made.

Steps, each timed into the report: unpack the trimmed FlashInfer into a temporary folder put on PYTHONPATH, with the
packed wheels this Python cannot import (tvm-ffi on a bare torch machine); import flashinfer; generate the sources
of every JIT module tests/gpu uses and resolve their #includes inside the pack (`--sources`, needs no GPU); build
those modules in parallel (`cases.JIT_COMBOS`: minutes each); run pytest on tests/gpu; then the decode step's time
split and host syncs per stage against the Llama-shaped torch target (`benchmarks/step_split.py`), and the step's ops,
torch's against the Triton kernels (`benchmarks/step_ops.py`). `--dry-run` stops
before the
builds (what `make gpu-pack` runs here). The report (markdown and JSON) goes to $OUT when set, else to stdout.
Exit status: pytest's, 0 for a dry run that got through, or 2 when a step failed.
"""

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_TESTS = REPO / "tests" / "gpu"
sys.path[:0] = [str(GPU_TESTS), str(REPO)]
from cases import HEAD_DIM, JIT_COMBOS  # noqa: E402
from pack import DROPPED, MANIFEST, TRIMMED  # noqa: E402

TAIL = 6000  # characters of a step's output kept in the report
IMPORT = "import flashinfer; print(flashinfer.__version__, flashinfer.__file__)"
TARGET_ARCH = "9.0a"  # the H200's, for generating sources where no GPU says which
# #include prefixes that must resolve inside the pack (the rest come with the CUDA toolkit or the C++ library)
PACKED_HEADERS = ("flashinfer/", "cub/", "cuda/", "nv/", "tvm/", "dlpack/", "spdlog/", "cutlass/", "cute/")


def run(cmd: list[str], env: dict, timeout: float) -> dict:
    """Run one step; its status, seconds and output tail."""
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        status = "timeout"
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
    return {"status": status, "seconds": round(time.monotonic() - start, 1), "output": output[-TAIL:]}


def install(pack: Path, site: Path, manifest: dict, env: dict) -> dict:
    """The trimmed FlashInfer into `site`, and each packed wheel whose module this Python cannot import, offline."""
    start = time.monotonic()
    with tarfile.open(pack / TRIMMED) as tf:
        tf.extractall(site, filter="data")
    log = []
    for module, wheel in manifest["wheels"].items():
        if subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0:
            log.append(f"{module}: already importable, {wheel} not installed")
            continue
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                               "--no-compile", "--target", str(site), str(pack / wheel)], capture_output=True,
                              text=True, env=env)
        log.append(f"{module}: installed {wheel} (pip exit {done.returncode})\n{done.stdout}{done.stderr}")
        if done.returncode:
            return {"status": done.returncode, "seconds": round(time.monotonic() - start, 1), "output": "\n".join(log)}
    return {"status": 0, "seconds": round(time.monotonic() - start, 1), "output": "\n".join(log)}


def unresolved_includes(sources: list[Path], roots: list[Path]) -> list[str]:
    """#includes reachable from `sources` (comments stripped) that are local or name a packed header but resolve
    under none of `roots`, as 'header (from file)'."""
    seen, todo, missing = set(), list(sources), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = re.sub(r"/\*.*?\*/|//[^\n]*", "", path.read_text(errors="replace"), flags=re.S)
        for quote, name in re.findall(r'#\s*include\s*([<"])([^>"]+)[>"]', text):
            found = next((p for p in (r / name for r in [path.parent, *roots]) if p.is_file()), None)
            if found is not None:
                todo.append(found.resolve())
            elif quote == '"' or name.startswith(PACKED_HEADERS):
                missing.add((name, path.name))
    return sorted(missing)


def check_sources() -> int:
    """Generate the JIT sources of every combination tests/gpu uses and resolve their includes (no GPU needed)."""
    import torch
    import tvm_ffi.libinfo
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.attention.modules import gen_batch_prefill_module
    from flashinfer.jit.quantization import gen_quantization_module

    specs = [gen_quantization_module()] + [
        gen_batch_prefill_module("fa2", q, kv, q, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, cap > 0, False)
        for q, kv, cap in JIT_COMBOS.values()]
    roots = [jit_env.FLASHINFER_INCLUDE_DIR, jit_env.FLASHINFER_CSRC_DIR, jit_env.SPDLOG_INCLUDE_DIR,
             *jit_env.CCCL_INCLUDE_DIRS, *jit_env.CUTLASS_INCLUDE_DIRS, Path(tvm_ffi.libinfo.find_include_path()),
             Path(tvm_ffi.libinfo.find_dlpack_include_path())]
    sources = [Path(s) for spec in specs for s in spec.sources]
    absent = [str(s) for s in sources if not s.is_file()]
    site = Path(jit_env.FLASHINFER_DATA).parents[1]
    dropped = set((site / DROPPED).read_text().splitlines())
    trimmed_away, upstream = [], []  # includes the trimming lost, and those the full wheel lacks too
    for name, origin in unresolved_includes([s for s in sources if s.is_file()], roots):
        wheel_paths = {str((r / name).relative_to(site)) for r in roots if r.is_relative_to(site)}
        (trimmed_away if wheel_paths & dropped else upstream).append(f"{name} (from {origin})")
    print(f"{len(specs)} JIT modules, {len(sources)} sources; absent sources: {absent}; includes the trimming "
          f"dropped: {trimmed_away}; includes absent from the whole wheel too (guarded out): {upstream}")
    return 1 if absent or trimmed_away else 0


def environment() -> dict:
    facts = {"python": platform.python_version(), "nvcc": shutil.which("nvcc"), "ninja": shutil.which("ninja")}
    try:
        import torch

        facts.update(torch=torch.__version__, cuda=torch.version.cuda,
                     device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception as e:  # report, do not stop: the steps below say what fails
        facts["torch"] = f"import failed: {e}"
    return facts


def report_markdown(report: dict) -> str:
    lines = ["# make gpu-check", "", f"- environment: `{json.dumps(report['environment'])}`",
             f"- pack: {report['pack'].get('pack_mib')} MiB, {report['pack'].get('flashinfer')}", "",
             "| step | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {name} | {step['status']} | {step['seconds']} |" for name, step in report["steps"].items()]
    for name, step in report["steps"].items():
        if step["status"] != 0 or name in ("sources", "pytest", "step split", "step ops"):
            lines += ["", f"## {name} (output tail)", "```", step["output"][-3000:].strip(), "```"]
    return "\n".join(lines) + "\n"


def checks(args, env: dict, site: Path, manifest: dict, deadline: float) -> dict:
    """The steps, in order, each only after those before passed (pytest runs after failed builds too)."""

    def left() -> float:
        return deadline - time.monotonic()

    python, script = sys.executable, str(Path(__file__).resolve())
    plan = [("import flashinfer", lambda: run([python, "-c", IMPORT], env, left())),
            ("sources", lambda: run([python, script, "--sources"], env, left()))]
    if not args.dry_run:
        plan += [("jit builds", lambda: build_all(env, left() - 60)),
                 ("pytest", lambda: run([python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                         str(GPU_TESTS)], env, left())),
                 ("step split", lambda: run([python, str(REPO / "benchmarks" / "step_split.py"), "--device", "cuda",
                                             "--repeats", "2"], env, left())),
                 ("step ops", lambda: run([python, str(REPO / "benchmarks" / "step_ops.py"), "--device", "cuda"], env,
                                          left()))]
    steps = {"install": install(args.pack, site, manifest, env)}
    for name, step in plan:
        if any(s["status"] != 0 for n, s in steps.items() if n != "jit builds"):  # tests rebuild what failed
            break
        steps[name] = step()
    return steps


def build_all(env: dict, timeout: float) -> dict:
    """Every JIT combination at once (each build is one ninja run of about ten nvcc jobs)."""
    warm = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(GPU_TESTS)!r}); import cases; "
            "cases.warm(sys.argv[1])"]
    with ThreadPoolExecutor(len(JIT_COMBOS)) as pool:
        builds = {name: pool.submit(run, [*warm, name], env, timeout) for name in JIT_COMBOS}
    results = {name: future.result() for name, future in builds.items()}
    failed = [name for name, r in results.items() if r["status"] != 0]
    return {"status": 1 if failed else 0, "seconds": max(r["seconds"] for r in results.values()),
            "output": "\n".join(f"{name}: {r['status']} in {r['seconds']} s\n{r['output'][-1500:]}"
                                for name, r in results.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", type=Path, default=Path(".gpu-pack"))
    parser.add_argument("--budget", type=float, default=560.0, help="seconds for the whole check")
    parser.add_argument("--dry-run", action="store_true", help="stop before the JIT builds (no GPU needed)")
    parser.add_argument("--jit-cache", type=Path, default=Path(tempfile.gettempdir()) / "sgl-dspark-flashinfer-jit",
                        help="FlashInfer's JIT cache: a rerun on the same machine reuses its builds")
    parser.add_argument("--sources", action="store_true", help="internal: the sources step, in its own process")
    args = parser.parse_args()
    if args.sources:
        return check_sources()
    deadline = time.monotonic() + args.budget
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    site = work / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "PYTHONUNBUFFERED": "1",
           "FLASHINFER_WORKSPACE_BASE": str(args.jit_cache),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    report = {"environment": environment(), "pack": json.loads((args.pack / MANIFEST).read_text())}
    if report["environment"].get("device") is None:
        env["FLASHINFER_CUDA_ARCH_LIST"] = TARGET_ARCH  # FlashInfer reads the target from the GPU when there is one
    try:
        report["steps"] = checks(args, env, site, report["pack"], deadline)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    passed = all(step["status"] == 0 for step in report["steps"].values())
    report["passed"] = passed and (args.dry_run or "pytest" in report["steps"])
    markdown = report_markdown(report)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu-check.md").write_text(markdown)
        (Path(out) / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(markdown)
    pytest_status = report["steps"].get("pytest", {}).get("status")
    if isinstance(pytest_status, int):
        return pytest_status
    return 0 if report["passed"] else 2


if __name__ == "__main__":
    sys.exit(main())
