"""The step-cost table of a running server: profiled at start-up from the target's own verify forward, and saved.

Owns the start-up profile (dummy TARGET_VERIFY batches run through SGLang's model runner and the configured
attention backend, timed by `cost.profile`) and `SavingBudget`, which writes the refitted table to a file.
Must not keep KV or request rows it borrows: the dummy batches use free pool slots before any request exists
and clear the request rows afterwards.
"""

import logging
import time
from dataclasses import dataclass

import torch

from sgl_dspark.cost import StepCostTable, profile, save_cost_table
from sgl_dspark.layout import pack_trees, verify_forward_input
from sgl_dspark.budget import PlanInput, BudgetPolicy, StepResult, VerifyPlan
from sgl_dspark.tree import DraftTree

PROFILE_MAX_TOKENS = 64  # the largest batch timed; the table extrapolates linearly beyond it
PROFILE_CONTEXT = 128  # committed tokens per dummy request (the keys each verify row attends over)
PROFILE_REPEATS = 3
PROFILE_BUDGET_S = 3.0  # no larger count starts once this much is spent (the table extrapolates beyond)
logger = logging.getLogger(__name__)


def token_counts(max_tokens: int) -> tuple[int, ...]:
    """Powers of two up to max_tokens, and max_tokens itself. Example: 20 -> (1, 2, 4, 8, 16, 20)."""
    counts = [1 << i for i in range(max(max_tokens, 1).bit_length()) if 1 << i <= max_tokens]
    return tuple(counts + ([max_tokens] if counts[-1] != max_tokens else []))


def verify_shape(tokens: int, max_width: int) -> tuple[int, int]:
    """tokens -> (requests, rows per request) with requests * rows == tokens and rows the widest <= max_width:
    how the worker lays out a verify step of that many tokens. Example: (32, 8) -> (4, 8); (12, 8) -> (2, 6)."""
    width = max(w for w in range(1, min(tokens, max_width) + 1) if tokens % w == 0)
    return tokens // width, width


@dataclass(frozen=True)
class ProfileLimits:
    max_width: int  # verify rows per request (the worker's stride)
    max_requests: int  # request rows the pool has
    kv_slots: int  # KV slots the pool has (slot 0 is SGLang's padding slot)
    context: int = PROFILE_CONTEXT

    def max_tokens(self) -> int:
        fits = (self.kv_slots - 1) // (self.context + self.max_width)  # requests whose KV fits the pool
        return max(1, min(PROFILE_MAX_TOKENS, self.max_width * min(self.max_requests, fits)))


class VerifyStep:
    """step(n): one TARGET_VERIFY forward of n tokens on the running target, shaped as the worker shapes it."""

    def __init__(self, model_runner, limits: ProfileLimits):
        self.runner = model_runner
        self.limits = limits

    def __call__(self, tokens: int) -> None:
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.ngram_info import NgramVerifyInput

        runner, context = self.runner, self.limits.context
        requests, width = verify_shape(tokens, self.limits.max_width)
        device = runner.device
        pool = runner.req_to_token_pool.req_to_token
        slots = 1 + torch.arange(requests * (context + width), device=device).view(requests, -1)
        pool[:requests, :context + width] = slots.to(pool.dtype)
        chains = [DraftTree.chain(torch.ones(width, dtype=torch.long), torch.ones(width))] * requests
        rows = verify_forward_input(pack_trees(chains, [context] * requests), [context] * requests,
                               prefix_columns=device != "cpu")  # the mask the worker builds for this device
        positions = rows.positions.to(device)
        spec = NgramVerifyInput(draft_token=torch.ones(tokens, dtype=torch.long, device=device),
                                custom_mask=rows.mask.to(device), positions=positions, draft_token_num=width)
        spec.capture_hidden_mode = CaptureHiddenMode.FULL
        seq_lens = torch.full((requests,), context, dtype=torch.int64)
        batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=requests, input_ids=spec.draft_token,
            req_pool_indices=torch.arange(requests, device=device), seq_lens=seq_lens.to(device),
            seq_lens_cpu=seq_lens, seq_lens_sum=requests * context, out_cache_loc=slots[:, context:].flatten(),
            positions=positions, spec_algorithm=runner.spec_algorithm, spec_info=spec,
            capture_hidden_mode=CaptureHiddenMode.FULL, return_hidden_states_before_norm=False)
        runner.kv_index_translator.own_plan(batch).bind(batch, runner.kv_index_translator)
        with torch.no_grad():
            out = runner.forward(batch).logits_output
        out.next_token_logits.float().cpu()  # as the worker's verify does; also waits for the device
        pool[:requests, :context + width] = 0


def profile_verify(model_runner, max_width: int, budget_s: float | None) -> StepCostTable:
    kv = model_runner.token_to_kv_pool
    limits = ProfileLimits(max_width, model_runner.req_to_token_pool.size, int(kv.size))
    step = VerifyStep(model_runner, limits)
    counts = token_counts(limits.max_tokens())
    step(1)  # one warm-up (first-call setup of the verify path), then each count timed as it comes
    return profile(step, counts, repeats=PROFILE_REPEATS, warmup=0, budget_s=budget_s)


def startup_table(model_runner, max_width: int, fallback: StepCostTable, ranks: int = 1) -> StepCostTable:
    """The profiled table, logged with its cost; the fallback (with a warning) if the dummy verify fails. Under
    tensor parallelism (ranks > 1) every rank runs the same dummy forwards, so every count is timed: a time budget
    would let ranks stop at different counts."""
    began = time.perf_counter()
    try:
        table = profile_verify(model_runner, max_width, PROFILE_BUDGET_S if ranks == 1 else None)
    except Exception as exc:  # a model or backend the dummy batch does not fit must not stop the server
        logger.warning("sgl-dspark: step-cost profiling failed (%s: %s); starting from the prior table, refitted "
                       "online", type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        return fallback
    logger.info("sgl-dspark: step-cost table profiled in %.1f s (TARGET_VERIFY, %d-token context): %s",
                time.perf_counter() - began, PROFILE_CONTEXT, describe(table))
    return table


def describe(table: StepCostTable) -> str:
    """One line: 'tokens=[1, 2, 4] ms=[70.1, 71.0, 74.2]'."""
    return f"tokens={list(table.tokens)} ms={[round(s * 1000, 1) for s in table.seconds]}"


class SavingBudget:
    """A verify budget that writes its cost table to `path` when given one and, refitted, every `every` observed steps.
    `cost_table` reads and sets the inner budget's table (the "off" mode has none; the last one set is kept)."""

    def __init__(self, inner: BudgetPolicy, table: StepCostTable, path: str, every: int, meta: dict | None = None):
        self.inner, self.path, self.every, self.meta = inner, path, max(every, 1), meta or {}
        self.table = table
        self.steps = 0

    def plan(self, batch: PlanInput) -> VerifyPlan:
        return self.inner.plan(batch)

    def observe(self, result: StepResult) -> None:
        self.inner.observe(result)
        self.steps += 1
        if self.steps % self.every == 0:
            self.save()

    @property
    def cost_table(self) -> StepCostTable:
        return getattr(self.inner, "cost_table", self.table)

    @cost_table.setter
    def cost_table(self, table: StepCostTable) -> None:
        self.table = table
        if hasattr(self.inner, "cost_table"):
            self.inner.cost_table = table
        self.save()

    def save(self) -> None:
        try:
            save_cost_table(self.cost_table, self.path, {**self.meta, "refit_steps": self.steps})
        except OSError as exc:
            logger.warning("sgl-dspark: cannot write the step-cost table to %s (%s)", self.path, exc)
