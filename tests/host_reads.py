"""Counting the host reads of device data on a CPU: where a step would wait for its accelerator.

On a GPU, reading a device tensor's values on the host (`.item()`, `.tolist()`, `.cpu()`, `if t.any():`, a boolean
mask index, `nonzero`) stops the host until the device is done. On a CPU nothing waits, so a test cannot see them
with CUDA's sync debug mode; `HostReads` sees them instead: tensors handed to `track` are "on the device", every torch
call with a tracked input makes tracked outputs (the data stays on the device), and every call of the kinds above on
a tracked tensor is counted, with its name. Host tensors the step builds itself (trees, sizes) stay untracked.
"""

from collections import Counter
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

T = torch.Tensor
# calls whose result is the tensor's values on the host, or whose output size depends on its values (a sync on CUDA)
READS = {T.item, T.tolist, T.cpu, T.numpy, T.__bool__, T.__int__, T.__float__, T.__index__, T.nonzero,
         torch.nonzero, T.masked_select, torch.masked_select, torch.equal, torch.allclose, T.unique, torch.unique,
         T.__repr__, T.__format__}
INDEXING = {T.__getitem__, T.__setitem__}  # a read when indexed by a boolean tensor (the mask's count is read)


class HostReads(TorchFunctionMode):
    """Counts host reads of tracked tensors while `active` (see the module docstring); `reads` names each one."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.reads: Counter[str] = Counter()
        self._tracked: dict[int, torch.Tensor] = {}  # id -> the tensor (held, so its id is not reused)

    def track(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._tracked[id(t)] = t

    def reset(self) -> None:
        self._tracked.clear()

    @contextmanager
    def paused(self):
        """Nothing is counted or tracked inside (work the caller does not count: a transfer it makes itself, a
        forward it stands in for); counting is on again after it."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def tracked(self, value) -> bool:
        return any(isinstance(x, torch.Tensor) and id(x) in self._tracked for x in tree_flatten(value)[0])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active or not self.tracked((args, kwargs)):
            return out
        if func in READS or (func in INDEXING and self._bool_index(args[1])):
            self.reads[getattr(func, "__name__", str(func))] += 1
        else:  # `.to(device)` included: the step moves to the logits' device, where tracked data already are
            self.track(*(x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)))
        return out

    @staticmethod
    def _bool_index(index) -> bool:
        return any(isinstance(x, torch.Tensor) and x.dtype == torch.bool for x in tree_flatten(index)[0])
