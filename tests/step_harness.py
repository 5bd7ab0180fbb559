"""The decode step (sgl_dspark.step) driven end to end by a fake forward and a real drafter, on a device of the
caller's choosing (tests/unit/test_step.py on the CPU, tests/gpu/test_step_cuda.py on CUDA), against plain decoding of
the same synthetic target.

The default target is a table: the logits after a token depend on the token and its position (mod 3), over a
12-token vocabulary; tests/torch_target.py has a small Llama-shaped one with a KV cache. The drafter is a seeded
random DSpark drafter, so it disagrees with the target most of the time and agrees some of it. The requests' prompts
repeat themselves, so the lookup branch has chains to graft.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sgl_dspark.config import DEFAULT_PRESET, load_config
from sgl_dspark.cost import from_measurements
from sgl_dspark.draft_worker.client import ContextUpdate, DraftWorkerUnavailable
from sgl_dspark.draft_worker.local import LocalDraftClient
from sgl_dspark.drafter import TargetWeights
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.layout import VerifyForwardInput
from sgl_dspark.sampling import SamplerBatch, SamplingParams, greedy_choices
from sgl_dspark.budget import StepResult, make_budget
from sgl_dspark.seeded import seeded_choices
from sgl_dspark.step import StepParts, StepRequest, Verified, decode_step
from sgl_dspark.step_ops import TORCH_OPS, StepOps
from sgl_dspark.suffix import lookup_registry

V = 12
SLOTS = 128
TOKENS = 24
TABLE = torch.Generator().manual_seed(28)
TARGET_LOGITS = 3.0 * torch.randn(3, V, V, generator=TABLE)  # [position % 3, token] -> next-token logits
FEATURES = torch.randn(3, V, 64, generator=TABLE)  # [position % 3, token] -> the target's hidden states
COST = from_measurements((1, 2, 4, 8, 16, 32), (0.020, 0.021, 0.022, 0.024, 0.030, 0.045))
PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5), (7, 7, 2, 8, 7, 7, 2, 8, 7, 7), (5, 3, 5, 3, 5, 3))
GREEDY, SEEDED = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.95)
KINDS = ((GREEDY, None), (GREEDY, None), (SEEDED, 1234))  # (sampling, sampling_seed) per request


def drafter(device: str = "cpu"):
    """The seeded drafter on `device`, borrowing its target's tables there (as the server's drafter borrows the
    target's)."""
    model, _ = random_drafter(tiny_hf_config(vocab_size=V, mask_token_id=V - 1, block_size=8, num_hidden_layers=1),
                              seed=3)
    if device != "cpu":
        target = model.target
        model.to(device).attach_target(TargetWeights(target.embed.to(device), target.lm_head.to(device)))
    return model


DRAFTER = drafter()


def features(tokens: list[int], positions: list[int]) -> torch.Tensor:
    return FEATURES[torch.tensor(positions) % 3, torch.tensor(tokens)]


class TableTarget:
    """The table target: its logits and features are lookups by (position mod 3, token); nothing to cache."""

    vocab = V

    def __init__(self, device: str = "cpu") -> None:
        self.table = TARGET_LOGITS.to(device)

    def prefill(self, b: int, tokens: Sequence[int]) -> torch.Tensor:
        return features(list(tokens), list(range(len(tokens))))

    def verify(self, verify: VerifyForwardInput, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The fake verify forward on the real rows: (logits [R, V] on the table's device, features [R, F])."""
        device, positions, tokens = self.table.device, verify.positions % 3, verify.tokens
        return self.table[positions.to(device), tokens.to(device)], FEATURES[positions.cpu(), tokens.cpu()]

    def commit(self, accepted) -> None:
        pass

    def plain(self, prompt: Sequence[int], tokens: int, choose) -> list[int]:
        out = [prompt[-1]]
        for _ in range(tokens):
            position = len(prompt) + len(out) - 2
            out.append(choose(TARGET_LOGITS[position % 3, out[-1]][None], position))
        return out[1:]


def plain_outputs(kinds=KINDS, target=None) -> list[list[int]]:
    """What plain decoding of the target (the table by default) gives each request of the batch: a greedy request
    takes the batch's greedy choice, a seeded one SGLang's seeded choice at each position."""
    target = target or TableTarget()
    sampler = SamplerBatch.of([k[0] for k in kinds])

    def chooser(params: SamplingParams, seed: int | None):
        if seed is None:
            return lambda logits, position: int(greedy_choices(logits, sampler)[0])
        return lambda logits, position: int(seeded_choices(logits.float().cpu(), params, seed,
                                                           torch.tensor([position]), sampler.filtered)[0])

    return [target.plain(p, TOKENS, chooser(*k)) for p, k in zip(PROMPTS, kinds)]


class FlakyClient:
    """The real local draft client, failing every `every`-th proposal as a dead draft worker would."""

    def __init__(self, inner: LocalDraftClient, every: int):
        self.inner, self.every, self.calls = inner, every, 0

    def propose(self, batch):
        self.calls += 1
        if self.calls % self.every == 0:
            raise DraftWorkerUnavailable("draft worker died", cause="dead")
        return self.inner.propose(batch)

    def write_context(self, update):
        self.inner.write_context(update)


class FollowerClient(FlakyClient):
    """A TP rank that does not plan: it keeps the drafter's context but must never be asked for drafts."""

    def __init__(self, inner: LocalDraftClient):
        super().__init__(inner, 1)

    def propose(self, batch):
        raise AssertionError("a rank that does not plan was asked for drafts")


@dataclass
class Run:
    outputs: list[list[int]]
    faults: list[str] = field(default_factory=list)
    accepted_drafts: int = 0  # draft tokens accepted over the run
    lookup_tokens: int = 0
    suffix_tokens: int = 0  # accepted tokens the suffix cache proposed
    steps: int = 0
    branching: int = 0  # verified blocks with a node of two or more children
    copied: list[int] = field(default_factory=list)  # per step: context rows the drafter copied out of its pool
    committed: list[int] = field(default_factory=list)  # per step: rows the commit gave the drafter's context


def decode(knobs: dict, preset: str = DEFAULT_PRESET, fail_every: int | None = None, device: str = "cpu",
           kinds=KINDS, on_step=None, drafter_on=DRAFTER, target=None, prompts=PROMPTS, tokens: int = TOKENS,
           seed: int = 0, earlier: Sequence[Sequence[int]] = (), shared=None, plans: bool = True,
           ops: StepOps = TORCH_OPS) -> Run:
    """The requests (one per prompt, `kinds` their sampling) decoded together through the step until each has
    `tokens` tokens after its prompt, against `target` (the table on `device` by default, or a
    tests/torch_target.LlamaTarget), the drafter's work on its own device (drafter_on: DRAFTER on the CPU, or
    drafter(device)); the verifier's stream seeded with `seed`; on_step(step, reqs, logits, sampler) runs before
    each step's acceptance; `earlier`: histories of requests that left before, in the suffix cache at the start;
    `shared`: StepParts.shared (tensor parallelism); plans=False: a TP rank that never plans (no lookup state, a
    client that refuses to draft); `ops`: the step's batched ops (sgl_dspark.step_ops)."""
    target = target or TableTarget(device)
    cfg = load_config(preset, overrides={"gate": False, **knobs})
    client = local = LocalDraftClient(drafter_on, cfg.draft_knobs(), len(prompts) * SLOTS, 11)
    if fail_every:
        client = FlakyClient(client, fail_every)
    if not plans:
        client = FollowerClient(client)
    lookup = lookup_registry(cfg.lookup_knobs(), cfg.suffix_cache_tokens) if cfg.lookup and plans else None
    for history in earlier:
        lookup.suffix.add(history)
    run = Run([[p[-1]] for p in prompts])
    stride = 1 + cfg.verify_nodes(drafter_on.config.gamma)
    parts = StepParts(cfg, client, make_budget(cfg, COST), lookup, None, target.vocab, stride,
                      draft_failed=lambda exc: run.faults.append(exc.cause), shared=shared, ops=ops)
    pool = torch.arange(len(prompts) * SLOTS).view(len(prompts), SLOTS)  # [request, position] -> KV slot
    slots = list(pool)
    for b, prompt in enumerate(prompts):  # prefill: the prompt's features but its last token's (the anchor)
        at = list(range(len(prompt) - 1))
        client.write_context(ContextUpdate(slots[b][at], torch.tensor(at), target.prefill(b, prompt[:-1])))
    sampler = SamplerBatch.of([k[0] for k in kinds])
    generator = torch.Generator().manual_seed(seed)  # the VERIFY stream (on the host, as the worker's)
    while min(len(o) for o in run.outputs) <= tokens:
        reqs = [StepRequest(f"r{b}", prompts[b][:-1], tuple(run.outputs[b]), len(prompts[b]) + len(run.outputs[b]) - 2,
                            slots[b], params, seed) for b, (params, seed) in enumerate(kinds)]
        observe = None if on_step is None else (lambda step, logits, reqs=reqs: on_step(step, reqs, logits, sampler))
        copied = local.rows_copied
        done = decode_step(parts, reqs, lambda step: Verified(*target.verify(
            ops.verify_input(step.rows, step.seq_lens, True, torch.device(device)), step.seq_lens)), sampler, generator,
            observe)
        step, verdict, commit = done.step, done.verdict, done.commit
        target.commit(verdict.host)
        hidden = done.verified.hidden
        client.write_context(ContextUpdate(pool[commit.front // step.rows.width, commit.positions], commit.positions,
                                           hidden[commit.kept.to(hidden.device)]))  # the drafter's context grows
        run.copied.append(local.rows_copied - copied)
        run.committed.append(commit.kept.numel())
        run.lookup_tokens += done.lookup_tokens
        run.steps += 1
        parts.budget.observe(StepResult(step.rows.real.numel(), COST.cost(step.rows.real.numel())))
        for b, result in enumerate(verdict.results):
            emitted = result.emitted_tokens.tolist()
            run.outputs[b] += emitted
            run.accepted_drafts += len(emitted) - 1
            tree, shared = step.trees[b].tree, step.trees[b].group >= 2 * len(cfg.lookup_knobs().sizes)
            run.branching += len(set(tree.parents[1:].tolist())) < tree.size - 1
            run.suffix_tokens += int(shared[result.accepted_nodes].sum())
    run.outputs = [o[1:tokens + 1] for o in run.outputs]
    return run
