"""Which implementation of the step's batched ops a device runs: the match walk, the accepted path's rows and the
verify mask and positions, in torch (any device) or as Triton kernels (sgl_dspark.step_kernels), chosen once at
start-up, per op, by timing both on a synthetic step on the device (`choose_ops`); torch's on the CPU and wherever
Triton is missing or fails. Must not import SGLang.
"""

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable

import torch

from sgl_dspark import acceptance
from sgl_dspark.layout import AcceptRows, VerifyForwardInput, VerifyRows, pack_trees, verify_forward_input
from sgl_dspark.tree import DraftTree, random_parents

logger = logging.getLogger(__name__)

OPS = ("matched_path", "path_rows", "verify_input")
PROBE_REQUESTS, PROBE_WIDTH, PROBE_CONTEXT = 64, 8, 1024  # the synthetic step the ops are timed on
PROBE_RUNS = 20


def torch_verify_input(rows: VerifyRows, seq_lens: list[int], prefix_columns: bool,
                       device: torch.device) -> VerifyForwardInput:
    """layout.verify_forward_input (host tensors; the forward puts them on `device`)."""
    return verify_forward_input(rows, seq_lens, prefix_columns)


@dataclasses.dataclass(frozen=True)
class StepOps:
    """The step's batched ops, each torch's or Triton's (`names`, in OPS order)."""

    matched_path: Callable[..., torch.Tensor]  # acceptance.matched_path's signature
    path_rows: Callable[..., AcceptRows]  # acceptance.path_rows's
    verify_input: Callable[[VerifyRows, list[int], bool, torch.device], VerifyForwardInput]
    names: tuple[str, str, str] = ("torch", "torch", "torch")


TORCH_OPS = StepOps(acceptance.matched_path, acceptance.path_rows, torch_verify_input)


@dataclasses.dataclass(frozen=True)
class OpTiming:
    op: str
    torch_ms: float  # median over PROBE_RUNS, synchronised
    triton_ms: float

    @property
    def chosen(self) -> str:
        return "triton" if self.triton_ms < self.torch_ms else "torch"


def triton_ops() -> StepOps:
    from sgl_dspark import step_kernels

    return StepOps(step_kernels.matched_path, step_kernels.path_rows, step_kernels.verify_forward_input,
                   ("triton", "triton", "triton"))


def choose_ops(device: torch.device, max_width: int = PROBE_WIDTH) -> tuple[StepOps, list[OpTiming]]:
    """Torch's ops on the CPU; on a GPU each op from whichever of torch and Triton times faster on the synthetic
    step (torch's everywhere, with the cause logged, when Triton cannot run). The kernels serving are built for
    every width up to `max_width` (the widest verify block) here, so no step waits on Triton's compiler."""
    if device.type != "cuda":
        return TORCH_OPS, []
    try:
        fast = triton_ops()
        timings = time_ops(TORCH_OPS, fast, device)
        ops = pick(timings, fast)
        warm(ops, device, max_width)
    except Exception as exc:  # Triton missing, or its compiler failed on this device: torch's ops serve
        logger.warning("sgl-dspark: the step's Triton kernels cannot run on %s (%s: %s); its torch ops serve",
                       device, type(exc).__name__, exc)
        return TORCH_OPS, []
    logger.info("sgl-dspark: step ops on %s (%d requests x %d rows, ms torch / triton): %s", device,
                PROBE_REQUESTS, PROBE_WIDTH,
                ", ".join(f"{t.op} {t.torch_ms:.3f} / {t.triton_ms:.3f} -> {t.chosen}" for t in timings))
    return ops, timings


def pick(timings: list[OpTiming], fast: StepOps) -> StepOps:
    """Each op (OPS order) from `fast` where it timed faster, else torch's."""
    chosen = [t.chosen for t in timings]
    return StepOps(*(getattr(fast if c == "triton" else TORCH_OPS, op) for op, c in zip(OPS, chosen)), tuple(chosen))


def probe_step(device: torch.device, gen: torch.Generator, requests: int = PROBE_REQUESTS,
               width: int = PROBE_WIDTH) -> tuple[VerifyRows, list[int], torch.Tensor]:
    """The synthetic step: `requests` random trees of `width` nodes after PROBE_CONTEXT cached tokens, and the
    target's choices (drawn so that about half of the drafts match)."""
    trees = []
    for _ in range(requests):
        parents = random_parents(width, gen)
        trees.append(DraftTree(torch.randint(0, 2, (width,), generator=gen), torch.tensor(parents),
                               torch.ones(width)))
    seq_lens = [PROBE_CONTEXT] * requests
    choices = torch.randint(0, 2, (requests, width), generator=gen).to(device)
    return pack_trees(trees, seq_lens, width), seq_lens, choices


def warm(ops: StepOps, device: torch.device, max_width: int) -> None:
    """Every op once at each power-of-two width up to `max_width` (the kernels' block sizes), both mask layouts."""
    width = 1
    while True:
        rows, seq_lens, choices = probe_step(device, torch.Generator().manual_seed(width), 2, min(width, max_width))
        tokens, parents = rows.tokens.view(-1, rows.width).to(device), rows.parents.to(device)
        on_path = ops.matched_path(tokens, parents, rows.mask.to(device), rows.sizes.to(device), choices)
        ops.path_rows(tokens, on_path, choices, max_width)
        for prefix in (False, True):
            ops.verify_input(rows, seq_lens, prefix, device)
        if width >= max_width:
            return
        width *= 2


def time_ops(base: StepOps, fast: StepOps, device: torch.device, requests: int = PROBE_REQUESTS) -> list[OpTiming]:
    """Each op of both on the probe step, after a warm-up call (Triton's compile), checked to agree first."""
    rows, seq_lens, choices = probe_step(device, torch.Generator().manual_seed(0), requests)
    tokens, parents = rows.tokens.view(-1, rows.width).to(device), rows.parents.to(device)
    mask, sizes = rows.mask.to(device), rows.sizes.to(device)
    on_path = base.matched_path(tokens, parents, mask, sizes, choices)
    calls = {
        "matched_path": lambda ops: ops.matched_path(tokens, parents, mask, sizes, choices),
        "path_rows": lambda ops: ops.path_rows(tokens, on_path, choices, rows.width),
        "verify_input": lambda ops: ops.verify_input(rows, seq_lens, True, device),
    }
    timings = []
    for op in OPS:
        call = calls[op]
        if not same(call(base), call(fast), device):
            raise RuntimeError(f"Triton's {op} disagrees with torch's on the probe step")
        timings.append(OpTiming(op, median_ms(call, base, device), median_ms(call, fast, device)))
    return timings


def same(a, b, device: torch.device) -> bool:
    """Equal results (tensors, or records of tensors and plain values), compared on `device`."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.to(device), b.to(device))
    values = [(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)]
    return all(same(x, y, device) if isinstance(x, torch.Tensor) else x == y for x, y in values)


def median_ms(call: Callable[[StepOps], object], ops: StepOps, device: torch.device) -> float:
    """Median wall time of `call` to its result on the device (host work included: the ops' callers wait for it)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    times = []
    for _ in range(PROBE_RUNS):
        sync(device)
        start = time.perf_counter()
        call(ops)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
