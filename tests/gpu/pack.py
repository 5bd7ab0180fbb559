"""`make gpu-pack`: what tests/gpu needs on a GPU machine without network access, packed into one folder.

The flashinfer-python wheel (65 MB) is trimmed to what FlashInfer's JIT build of its fa2 prefill and packbits kernels
reads: the Python package (its .py files and small data files), data/include, the top-level files of data/csrc,
data/spdlog and the CCCL headers (cub, thrust, libcudacxx: thrust from the same release as cub, since CUDA 13's own
thrust refuses another release's cub with an #error). It travels as one .tar.xz, with the wheels of FlashInfer's
imports that a bare torch machine may lack beside it (`WHEELS`: check.py installs those it cannot import). Runs
here, where pip reaches the package index; `check.py` unpacks it there.
"""

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

TRIMMED = "flashinfer-trimmed.tar.xz"
MANIFEST = "manifest.json"
DROPPED = "flashinfer-dropped.txt"  # inside the tar: the wheel's files the trimmed copy leaves out, one a line
PYNVML = "nvidia-ml-py"  # FlashInfer imports pynvml; pure Python, unpinned (only installed where missing)
DATA = "flashinfer/data/"
DATA_TREES = ("include/", "spdlog/", "cccl/cub/cub/", "cccl/thrust/thrust/", "cccl/libcudacxx/include/")
PACKAGE_FILES = (".py", ".json", "py.typed")
UNTRACK_HINT = ("the pack itself is complete. For the device call only, leave a large tracked file behind: "
                "`git rm -q --cached FILE && echo /FILE >> .git/info/exclude`; right after it, "
                "`git reset -q HEAD -- FILE` and delete that line from .git/info/exclude")


def keep(name: str) -> bool:
    """Members of the flashinfer wheel the trimmed copy keeps. Examples: flashinfer/prefill.py, flashinfer/data/csrc/
    batch_prefill.cu (top level of csrc) are kept; flashinfer/data/csrc/fused_moe/x.cu and flashinfer/data/cutlass/
    ... are not."""
    if name.startswith("flashinfer_python-") and ".dist-info/" in name:
        return not name.endswith("/RECORD")  # the trimmed copy no longer matches the wheel's record
    if not name.startswith("flashinfer/") or name.endswith("/"):
        return False
    if not name.startswith(DATA):
        return name.endswith(PACKAGE_FILES)
    rest = name[len(DATA):]
    return rest.startswith(DATA_TREES) or (rest.startswith("csrc/") and rest.count("/") == 1)


def download(spec: str, dest: Path, *platform_args: str) -> Path:
    """pip download one wheel (no dependencies) into dest; the path of the wheel."""
    before = set(dest.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "--only-binary=:all:", *platform_args, "-d", str(dest), spec], check=True)
    name = spec.split("==")[0].split("[")[0].replace("-", "_").lower()
    wheels = [w for w in dest.glob("*.whl") if w.name.lower().startswith(name + "-")]
    if len(wheels) != 1:
        raise SystemExit(f"gpu-pack: expected one {name} wheel in {dest}, found {[w.name for w in wheels]} "
                         f"(new: {[w.name for w in set(dest.glob('*.whl')) - before]})")
    return wheels[0]


def trim(wheel: Path, out: Path) -> int:
    """Write the kept members of `wheel` to the tar.xz `out`, with the list of the dropped ones; the number kept."""
    dropped = []
    with zipfile.ZipFile(wheel) as zf, tarfile.open(out, "w:xz") as tf:
        for info in zf.infolist():
            if not keep(info.filename):
                dropped.append(info.filename)
                continue
            with zf.open(info) as src:
                tf.addfile(member(info.filename, info.file_size), src)
        listing = "\n".join(dropped).encode()
        tf.addfile(member(DROPPED, len(listing)), io.BytesIO(listing))
    return len(zf.infolist()) - len(dropped)


def member(name: str, size: int) -> tarfile.TarInfo:
    entry = tarfile.TarInfo(name)
    entry.size, entry.mode, entry.mtime = size, 0o644, 0
    return entry


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_bytes(repo: Path) -> int:
    """Bytes of what travels with the working tree besides the pack: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((repo / n.decode()).stat().st_size for n in names if n and (repo / n.decode()).is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flashinfer", required=True, help="pip spec, e.g. flashinfer-python==0.7.2")
    parser.add_argument("--tvm-ffi", required=True, help="pip spec, e.g. apache-tvm-ffi==0.1.11")
    parser.add_argument("--out", type=Path, default=Path(".gpu-pack"))
    parser.add_argument("--cache", type=Path, default=Path("build/gpu-pack-cache"), help="where the full wheel waits")
    parser.add_argument("--max-mib", type=float, default=40.0, help="largest pack allowed")
    parser.add_argument("--travel-mib", type=float, default=64.0, help="largest pack + working tree allowed")
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    for old in args.out.iterdir():
        old.unlink()
    flashinfer = download(args.flashinfer, args.cache)
    wheels = {"tvm_ffi": download(args.tvm_ffi, args.out, "--implementation", "cp", "--python-version", "3.12",
                                  "--platform", "manylinux_2_28_x86_64"),
              "pynvml": download(PYNVML, args.out)}
    trimmed = args.out / TRIMMED
    files = trim(flashinfer, trimmed)
    parts = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in (trimmed, *wheels.values())}
    pack_mib = sum(p["bytes"] for p in parts.values()) / 2**20
    travel_mib = pack_mib + tree_bytes(Path.cwd()) / 2**20
    manifest = {"flashinfer": args.flashinfer, "flashinfer_wheel": flashinfer.name, "trimmed_files": files,
                "wheels": {module: wheel.name for module, wheel in wheels.items()}, "parts": parts,
                "pack_mib": round(pack_mib, 2), "with_working_tree_mib": round(travel_mib, 2)}
    (args.out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"gpu-pack: {args.out}/ holds {pack_mib:.1f} MiB ({files} FlashInfer files from {flashinfer.name}, "
          f"{', '.join(w.name for w in wheels.values())}); with the working tree {travel_mib:.1f} MiB travel")
    if pack_mib > args.max_mib or travel_mib > args.travel_mib:
        raise SystemExit(f"gpu-pack: too large: pack {pack_mib:.1f} MiB (limit {args.max_mib}), with the working "
                         f"tree {travel_mib:.1f} MiB (limit {args.travel_mib}); {UNTRACK_HINT}")


if __name__ == "__main__":
    main()
