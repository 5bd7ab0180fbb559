"""Shared-memory arenas: one file in a RAM-backed directory (/dev/shm), mapped, carrying one step's bulk tensors.

The writer bump-allocates tensors after `reset()` (`put` -> TensorRef); the reader maps the file by path and views
a TensorRef as a tensor. The client owns its arenas (`GrowingArena`: create, grow under a new name, unlink); the
worker only maps them (`ArenaMaps`). Must not know message semantics beyond TensorRef.
"""

import math
import mmap
import os
import stat
import uuid
from pathlib import Path

import torch

from sgl_dspark.draft_worker.messages import TensorRef

ALIGN = 64  # bytes; every tensor starts on a cache line
PREFIX = "sgl_dspark_"  # every arena file is named sgl_dspark_<creator pid>_<tag>_<random>
DEFAULT_DIR = "/dev/shm"
MIB = 1 << 20
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                                     torch.int32, torch.uint8, torch.bool)}


class ArenaFull(RuntimeError):
    """A tensor does not fit in the arena's remaining space."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def footprint(tensors: list[torch.Tensor]) -> int:
    """Bytes an arena needs to hold `tensors` after a reset."""
    return sum(aligned(t.numel() * t.element_size()) for t in tensors)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"shm: dtype {name} is not supported (supported: {', '.join(DTYPES)})")
    return name


class Arena:
    """A writable mapping of one shared-memory file of fixed size."""

    def __init__(self, path: str, owner: bool) -> None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # a symlink planted under our name is refused (ELOOP)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise PermissionError(f"shm: {path} is not a regular file of this user")
            self.size = st.st_size
            self.map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.path, self.owner, self.used = path, owner, 0

    @staticmethod
    def create(directory: str, size: int, tag: str) -> "Arena":
        """A new file `<directory>/sgl_dspark_<pid>_<tag>_<random>` with its pages reserved, so a full tmpfs
        fails here (ENOSPC) rather than with SIGBUS on first touch."""
        path = f"{arena_prefix(directory)}{tag}_{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(size, ALIGN))
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return Arena(path, owner=True)

    def reset(self) -> None:
        self.used = 0

    def put(self, tensor: torch.Tensor) -> TensorRef:
        """Copy `tensor` (any device) into the next free region."""
        src = tensor.detach()
        nbytes = src.numel() * src.element_size()
        if self.used + nbytes > self.size:
            raise ArenaFull(f"shm: {nbytes} bytes do not fit in arena {self.path} ({self.size - self.used} left)")
        ref = TensorRef(self.path, self.used, tuple(src.shape), dtype_name(src.dtype))
        self.used += aligned(nbytes)
        if nbytes:
            self.view(ref).copy_(src)
        return ref

    def view(self, ref: TensorRef) -> torch.Tensor:
        """The tensor `ref` names, sharing this arena's memory (valid until the writer's next reset)."""
        if ref.arena != self.path:
            raise ValueError(f"shm: {ref.arena} is not this arena ({self.path})")
        if ref.dtype not in DTYPES:
            raise ValueError(f"shm: dtype {ref.dtype!r} is not supported")
        dtype, count = DTYPES[ref.dtype], math.prod(ref.shape)
        end = ref.offset + count * dtype.itemsize
        if min(ref.shape, default=0) < 0 or ref.offset < 0 or end > self.size:
            raise ValueError(f"shm: {ref.shape} {ref.dtype} at {ref.offset} lies outside {self.path} ({self.size} B)")
        if count == 0:
            return torch.empty(ref.shape, dtype=dtype)
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=ref.offset).view(ref.shape)

    def close(self) -> None:
        """Unmap (once no view is alive; else when the last one dies) and, for the owner, remove the file."""
        try:
            self.map.close()
        except BufferError:  # views still alive keep the mapping; the memory goes with them
            pass
        if self.owner:
            unlink(self.path)


def arena_prefix(directory: str) -> str:
    """The path every arena this process creates in `directory` starts with."""
    return str(Path(directory) / f"{PREFIX}{os.getpid()}_")


def creator_pid(name: str) -> int | None:
    """The pid in an arena file name `sgl_dspark_<pid>_<tag>_<hex>`, None for any other name."""
    pid, _, rest = name.removeprefix(PREFIX).partition("_")
    return int(pid) if name.startswith(PREFIX) and pid.isdigit() and rest else None


def space(directory: str) -> str:
    """'size 64 MiB, 3 MiB free' for `directory`'s filesystem (or why that is unknown), for error messages."""
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        return f"size unknown: {exc.strerror}"
    return f"size {st.f_blocks * st.f_frsize // MIB} MiB, {st.f_bavail * st.f_frsize // MIB} MiB free"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(path: Path) -> bool:
    """One of this user's arena files (not a link) whose creating process is gone."""
    pid = creator_pid(path.name)
    if pid is None:
        return False
    st = path.lstat()
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not pid_alive(pid)


def sweep_stale(directory: str = DEFAULT_DIR) -> list[str]:
    """Unlink this user's arenas whose creating process is gone (a killed server cannot unlink its own; tmpfs pages
    are RAM). Others' files, and any file that cannot be read or removed, are left alone. Returns the removed paths."""
    removed = []
    try:
        candidates = list(Path(directory).glob(f"{PREFIX}*"))
    except OSError:
        return removed
    for path in candidates:
        try:
            if is_stale(path):
                os.unlink(path)
                removed.append(str(path))
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


SHRINK_AFTER = 32  # consecutive steps that fit the initial size before a grown arena goes back to it


class GrowingArena:
    """The writer's side: an owned arena replaced by a bigger file (new path) when a step needs more room, and by
    one of its initial size again once SHRINK_AFTER steps in a row fit that (a burst of load does not keep its
    shared memory for the server's lifetime; the reader drops the old mapping when it maps the new path)."""

    def __init__(self, directory: str, size: int, tag: str) -> None:
        self.directory, self.tag, self.initial = directory, tag, size
        self.small_steps = 0
        sweep_stale(directory)
        self.arena = Arena.create(directory, size, tag)

    @property
    def path(self) -> str:
        return self.arena.path

    def ensure(self, nbytes: int) -> None:
        """Make room for `nbytes` after a reset: at least double the file when it must grow."""
        self.small_steps = self.small_steps + 1 if nbytes <= self.initial < self.arena.size else 0
        if nbytes > self.arena.size:
            self._replace(max(nbytes, 2 * self.arena.size))
        elif self.small_steps >= SHRINK_AFTER:
            self._replace(self.initial)
            self.small_steps = 0
        self.arena.reset()

    def _replace(self, size: int) -> None:
        fresh = Arena.create(self.directory, size, self.tag)
        self.arena.close()
        self.arena = fresh

    def put_all(self, tensors: list[torch.Tensor]) -> list[TensorRef]:
        """Reset (growing if needed), then store every tensor."""
        self.ensure(footprint(tensors))
        return [self.arena.put(t) for t in tensors]

    def view(self, ref: TensorRef) -> torch.Tensor:
        return self.arena.view(ref)

    def close(self) -> None:
        self.arena.close()


class ArenaMaps:
    """The reader's side: arenas mapped by path on first sight; a mapping is dropped once its file is unlinked.
    Maps only files whose path starts with `prefix` (one client's arenas, `arena_prefix`): any other path raises
    ValueError before anything is opened."""

    def __init__(self, prefix: str) -> None:
        if not Path(prefix).name.startswith(PREFIX):
            raise ValueError(f"shm: arena prefix {prefix} does not name {PREFIX}* files")
        self.prefix = prefix
        self.maps: dict[str, Arena] = {}

    def allows(self, path: str) -> bool:
        """A file directly in the prefix's directory (no '..', no other directory) named with the prefix."""
        p, want = Path(path), Path(self.prefix)
        return p.parent == want.parent and p.name.startswith(want.name) and ".." not in p.parts

    def get(self, path: str) -> Arena:
        if path not in self.maps:
            if not self.allows(path):
                raise ValueError(f"shm: {path} is not an arena of this client ({self.prefix}*)")
            self._drop_unlinked()
            self.maps[path] = Arena(path, owner=False)
        return self.maps[path]

    def view(self, ref: TensorRef) -> torch.Tensor:
        return self.get(ref.arena).view(ref)

    def _drop_unlinked(self) -> None:
        for path in [p for p in self.maps if not os.path.exists(p)]:
            self.maps.pop(path).close()

    def close(self) -> None:
        for arena in self.maps.values():
            arena.close()
        self.maps.clear()
