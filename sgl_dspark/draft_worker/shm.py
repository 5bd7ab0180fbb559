"""Shared-memory arenas: one file in a RAM-backed directory (/dev/shm), mapped, carrying one step's bulk tensors.

The writer bump-allocates tensors after `reset()` (`put` -> TensorRef); the reader maps the file by path and views
a TensorRef as a tensor. The client owns its arenas (`GrowingArena`: create, grow under a new name, unlink); the
worker only maps them (`ArenaMaps`). Must not know message semantics beyond TensorRef.
"""

import mmap
import os
import uuid
from pathlib import Path

import torch

from sgl_dspark.draft_worker.messages import TensorRef

ALIGN = 64  # bytes; every tensor starts on a cache line
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
        fd = os.open(path, os.O_RDWR)
        try:
            self.size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.path, self.owner, self.used = path, owner, 0

    @staticmethod
    def create(directory: str, size: int, tag: str) -> "Arena":
        """A new file `<directory>/sgl_dspark_<pid>_<tag>_<random>` with its pages reserved, so a full tmpfs
        fails here (ENOSPC) rather than with SIGBUS on first touch."""
        path = str(Path(directory) / f"{PREFIX}{os.getpid()}_{tag}_{uuid.uuid4().hex[:8]}")
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
        dtype = DTYPES[ref.dtype]
        count = 1
        for d in ref.shape:
            count *= d
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


PREFIX = "sgl_dspark_"
DEFAULT_DIR = "/dev/shm"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = DEFAULT_DIR) -> list[str]:
    """Unlink arenas whose creating process is gone (a killed server cannot unlink its own; tmpfs pages are RAM).
    Returns the removed paths."""
    removed = []
    for path in Path(directory).glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):].split("_", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            unlink(str(path))
            removed.append(str(path))
    return removed


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class GrowingArena:
    """The writer's side: an owned arena replaced by a bigger file (new path) when a step needs more room."""

    def __init__(self, directory: str, size: int, tag: str) -> None:
        self.directory, self.tag = directory, tag
        sweep_stale(directory)
        self.arena = Arena.create(directory, size, tag)

    @property
    def path(self) -> str:
        return self.arena.path

    def ensure(self, nbytes: int) -> None:
        """Make room for `nbytes` after a reset: at least double the file when it must grow."""
        if nbytes > self.arena.size:
            bigger = Arena.create(self.directory, max(nbytes, 2 * self.arena.size), self.tag)
            self.arena.close()
            self.arena = bigger
        self.arena.reset()

    def put_all(self, tensors: list[torch.Tensor]) -> list[TensorRef]:
        """Reset (growing if needed), then store every tensor."""
        self.ensure(footprint(tensors))
        return [self.arena.put(t) for t in tensors]

    def view(self, ref: TensorRef) -> torch.Tensor:
        return self.arena.view(ref)

    def close(self) -> None:
        self.arena.close()


class ArenaMaps:
    """The reader's side: arenas mapped by path on first sight; a mapping is dropped once its file is unlinked."""

    def __init__(self) -> None:
        self.maps: dict[str, Arena] = {}

    def get(self, path: str) -> Arena:
        if path not in self.maps:
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
