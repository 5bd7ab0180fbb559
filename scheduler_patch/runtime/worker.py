"""The SGLang-facing DSpark worker (SGLang's V2 speculative-worker interface), CPU and GPU.

A decode step is `sgl_dspark.step.decode_step` (draft -> plan -> pack -> verify -> constrain -> accept -> commit
record -> learn) with this worker's verify forward (SGLang's target on the verify batch) and custom logit
processors handed in; the worker then writes what SGLang needs: logprobs, the commit (the accepted path's KV kept,
the drafter fed its features), the trace, the step's cost and metrics (observe), SGLang's result. It owns no
algorithm itself.
"""

import logging

import torch

from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from sgl_dspark.constraints import Penalties
from sgl_dspark.draft_worker.client import ContextUpdate, DraftClient, DraftWorkerUnavailable
from sgl_dspark.features import refusal
from sgl_dspark.gate import Gate, GatedStep, initial_costs
from sgl_dspark.layout import AcceptRows
from sgl_dspark.suffix import lookup_registry
from sgl_dspark.observe import StepClock, StepStats, result_counts
from sgl_dspark.sampling import SamplerBatch, SamplingParams
from sgl_dspark.budget import StepResult
from sgl_dspark.seeded import seeded_from_probs
from sgl_dspark.step import DecodeStep, StepOutcome, StepParts, StepRequest, Verified, decode_step, draft_batch
from sgl_dspark.step_ops import choose_ops
from sgl_dspark.streams import VERIFY, stream
from sgl_dspark.trace import TraceWriter, step_trace
from sgl_dspark.verify import VerifyResult

from scheduler_patch.launch import launch_of
from scheduler_patch.runtime.setup import (WorkerSetup, build_setup, prior_cost_table, release_freed_memory,
                                          start_cost_table, worker_metrics)
from scheduler_patch.runtime.verify_mode import verifying
from scheduler_patch.runtime.tensor_parallel import RankZeroPlan, tp_group

logger = logging.getLogger(__name__)


def request_sampling(req) -> SamplingParams:
    p = req.sampling_params
    return SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)


def sampler_batch(info) -> SamplerBatch:
    """SGLang's batch-wide sampling decisions for this batch (they decide how tied logits break)."""
    filtered = info.need_top_p_sampling or info.need_top_k_sampling or info.need_min_p_sampling
    return SamplerBatch(bool(info.is_all_greedy), bool(filtered), info.max_top_k)


def request_penalties(req) -> Penalties:
    """The request's penalties, with the stop tokens SGLang's min_new_tokens penalizer masks (gathered only when
    min_new_tokens is set: this runs for every request every step)."""
    p, tokenizer = req.sampling_params, getattr(req, "tokenizer", None)
    stops = set()
    if p.min_new_tokens > 0:
        stops = set(p.stop_token_ids or ()) | set(req.eos_token_ids or ())
        if tokenizer is not None:
            stops |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
            if getattr(tokenizer, "eos_token_id", None) is not None:
                stops.add(tokenizer.eos_token_id)
    return Penalties(p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.min_new_tokens, tuple(stops))


def host_ints(batch, name: str) -> list[int]:
    """SGLang's batch tensor `name` as ints, from the copy its scheduler keeps on the host (`<name>_cpu`) when it
    has one, so the step does not wait on the device for it."""
    host = getattr(batch, f"{name}_cpu", None)
    return (host if host is not None else getattr(batch, name)).tolist()


def refuse_unsupported(reqs) -> None:
    """Requests using a feature DSPARK cannot serve exactly (sgl_dspark.features) end with a 400 and one line."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for req in reqs:
        if req.to_finish is None and (reason := refusal(req.sampling_params, req)):
            req.to_finish = FINISH_ABORT(reason, HTTPStatus.BAD_REQUEST, "BadRequestError")


class DSparkWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.launch = launch_of(server_args)
        self.setup: WorkerSetup = build_setup(self.launch, server_args, self.model_runner)
        self.stride = self.launch.verify_tokens  # padded row width of the flattened output
        self.speculative_num_draft_tokens = self.stride
        self.client: DraftClient | None = None  # made once the KV pool (its slot count) exists
        self.parts: StepParts | None = None  # the step's collaborators (sgl_dspark.step), with the client
        self.budget = self.setup.budget
        group = tp_group()
        self.shared = None if group is None else RankZeroPlan(group)  # under TP: rank 0 plans every step
        plans = self.shared is None or self.shared.leader  # the other ranks keep no lookup state: they never draft
        self.lookup = None if self.launch.lookup is None or not plans else \
            lookup_registry(self.launch.lookup, self.setup.config.suffix_cache_tokens)
        self.metrics = worker_metrics(server_args, plans)
        self.tracer = TraceWriter(self.setup.config.trace) if self.setup.config.trace else None
        self.generator = stream(int(server_args.random_seed or 0), VERIFY)  # the verifier's own stream
        self.vocab = int(self.model_runner.model_config.vocab_size)
        self.full_mask = self.device != "cpu"
        self.ops, _ = choose_ops(torch.device(self.device), self.stride)  # Triton's where they time faster (GPU)
        self.gate = Gate(initial_costs(prior_cost_table(), self.setup.kernels), self.setup.config.gate_margin) \
            if self.setup.config.gate and self.setup.config.drafts else None
        self.last_decode_end: float | None = None  # when the previous decode step returned (None: a prefill since)

    @property
    def draft_worker(self):
        return None

    def alloc_memory_pool(self, **kwargs):
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()
        kv = self.token_to_kv_pool_allocator.get_kvcache()
        self.client = self.setup.make_client(kv.size + kv.page_size, int(self.server_args.random_seed or 0))
        self.parts = StepParts(self.setup.config, self.client, self.budget, self.lookup, self.gate, self.vocab,
                               self.stride, self.draft_failed, self.shared, self.ops)

    def init_cuda_graphs(self):
        """SGLang's last start-up step (the KV pools and attention backends exist): profile the step-cost table."""
        start_cost_table(self.setup, self.model_runner)
        if str(self.device) == "cpu":
            logger.info("sgl-dspark: start-up over, %.0f MB of freed memory returned to the OS",
                        release_freed_memory() / 2**20)

    def clear_cache_pool(self):
        pass

    # -- the V2 entry point -------------------------------------------------------------------------------

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None, **_):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return self.prefill(batch, on_publish)
        if batch.forward_mode.is_idle():
            raise RuntimeError("sgl-dspark: idle batches (data-parallel attention) are not supported")
        return self.decode(batch, on_publish)

    # -- prefill: the target runs as usual and hands its features to the drafter --------------------------

    def prefill(self, batch, on_publish):
        refuse_unsupported(batch.reqs)
        self.last_decode_end = None
        result = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        self.seed_first_tokens(batch, result)
        features = result.logits_output.hidden_states
        result.logits_output.hidden_states = None
        self.write_context(batch.out_cache_loc, self.extend_positions(batch), features,
                           tuple(req.rid for req in batch.reqs))  # their contexts start (over) here
        bs = len(batch.reqs)
        tokens = torch.zeros(bs, self.stride, dtype=torch.long)
        tokens[:, 0] = result.next_token_ids.cpu()
        result.new_seq_lens = batch.seq_lens
        result.next_draft_input = self.relay(batch.seq_lens, tokens, torch.ones(bs, dtype=torch.int32))
        result.speculative_num_draft_tokens = self.stride
        if on_publish is not None:
            on_publish(batch.seq_lens)
        return result

    @staticmethod
    def seed_first_tokens(batch, result) -> None:
        """A seeded request's prefill token is SGLang's seeded choice too (its sampler ignores sampling_seed unless
        --enable-deterministic-inference), so one seed gives one output from the first token on. SGLang's sampler
        has already turned a sampled batch's logits into softmax(logits / T) in place; a row that is not a
        distribution (an unsampled path) is taken as logits."""
        out = result.logits_output
        for b, req in enumerate(batch.reqs):
            params, seed = request_sampling(req), req.sampling_params.sampling_seed
            if seed is None or params.is_greedy:
                continue
            row = out.next_token_logits[b:b + 1].float().cpu()
            if not (bool((row >= 0).all()) and abs(float(row.sum()) - 1.0) < 1e-3):
                row = torch.softmax(row / params.temperature, dim=-1)
            token = seeded_from_probs(row, params, int(seed), torch.tensor([int(batch.seq_lens[b]) - 1]),
                                      sampler_batch(batch.sampling_info).filtered)
            result.next_token_ids[b] = token.to(result.next_token_ids.device)[0]
            if batch.return_logprob and out.next_token_logprobs is not None:  # SGLang's: log of that row
                out.next_token_logprobs[b] = torch.log(row[0, token[0]])

    @staticmethod
    def extend_positions(batch) -> torch.Tensor:
        parts = [torch.arange(p, p + n) for p, n in zip(batch.prefix_lens, batch.extend_lens)]
        return torch.cat(parts).to(torch.long)

    def write_context(self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                      restart: tuple[str, ...] = ()) -> None:
        try:
            self.client.write_context(ContextUpdate(slots.long(), positions, features.detach(), restart))  # in place
        except DraftWorkerUnavailable as exc:
            self.draft_failed(exc)

    # -- decode: the step (sgl_dspark.step), then logprobs -> commit -> observe -> SGLang's result -----------

    def decode(self, batch, on_publish):
        clock, hits, shared_s = StepClock(), self.client.ahead_hits, self.share_seconds()
        reqs = self.step_requests(batch)
        done = decode_step(self.parts, reqs, lambda step: self.verify(batch, step, clock),
                           sampler_batch(batch.sampling_info), self.generator,
                           lambda step, logits: self.custom_logits(batch, step, logits))
        step, verdict, logits_output = done.step, done.verdict, done.verified.output
        logits_output.next_token_logits = done.verified.logits  # in the fixed width, as logprobs index it
        if batch.return_logprob:
            self.logprobs(batch, logits_output, verdict.rows, step.rows.width)
        new_seq_lens = self.commit(batch, done)
        if self.setup.config.draft_ahead and self.setup.config.drafts:  # early: it overlaps the rest of the step
            self.draft_ahead(reqs, verdict.host)
        self.trace(batch, step, verdict.results)
        logits_output.hidden_states = None
        if on_publish is not None:
            on_publish(new_seq_lens)
        self.observe(batch, step, verdict.host, clock, hits, self.share_seconds() - shared_s, done.lookup_tokens)
        return self.step_result(step, logits_output, verdict.rows, new_seq_lens)

    def verify(self, batch, step: DecodeStep, clock: StepClock) -> Verified:
        """The target's forward on the step's verify rows (SGLang's batch carries them for its duration)."""
        clock.mark_drafted()
        with verifying(batch, self.ops.verify_input(step.rows, step.seq_lens, self.full_mask, self.device),
                       self.req_to_token_pool.req_to_token, self.device):
            out = self.target_worker.forward_batch_generation(batch, is_verify=True)
        clock.mark_verified()
        return Verified(out.logits_output.next_token_logits, out.logits_output.hidden_states, out.logits_output)

    def step_requests(self, batch) -> list[StepRequest]:
        """The batch's requests as the step sees them (sgl_dspark.step), from the host's copies of SGLang's lengths
        and pool rows (no read of the device's)."""
        req_to_token = self.req_to_token_pool.req_to_token  # each request's row, a view
        return [StepRequest(req.rid, req.origin_input_ids, req.output_ids, n, req_to_token[i], request_sampling(req),
                            req.sampling_params.sampling_seed, request_penalties(req), req.sampling_params.logit_bias,
                            req.grammar, bool(req.custom_logit_processor))
                for req, i, n in zip(batch.reqs, host_ints(batch, "req_pool_indices"), host_ints(batch, "seq_lens"))]

    def trace(self, batch, step: DecodeStep, results: list[VerifyResult]) -> None:
        if self.tracer is not None:
            self.tracer.write([step_trace(req.rid, g, n, r)
                               for req, g, n, r in zip(batch.reqs, step.trees, step.drafted, results)])

    def share_seconds(self) -> float:
        """Under TP, this rank's time in plan broadcasts so far (0.0 without TP)."""
        return 0.0 if self.shared is None else self.shared.seconds

    def observe(self, batch, step: DecodeStep, accepted: AcceptRows, clock: StepClock, hits: int,
                share_s: float, lookup_tokens: int) -> None:
        """The step's cost to the verify budget (its online refit) and to the gate, its statistics to the metrics."""
        self.budget.observe(StepResult(step.rows.real.numel(), clock.verify_s))
        verified, taus, tail_s = step.rows.sizes.tolist(), accepted.accept_lens.tolist(), clock.since_verified()
        host_s = None if self.last_decode_end is None else clock.start - self.last_decode_end  # SGLang's, between
        if self.gate is not None:
            self.gate.observe(GatedStep([req.rid for req in batch.reqs], step.speculated, taus,
                                        [v - 1 for v in verified], clock.draft_s, tail_s, host_s))
        self.metrics.observe(StepStats(step.drafted, verified, taus, clock.draft_s, clock.verify_s, tail_s,
                                       self.client.ahead_hits - hits, step.speculated, share_s,
                                       lookup_tokens, host_s))
        self.last_decode_end = clock.clock()
        lookup, suffix = self.lookup, self.lookup and self.lookup.suffix
        self.metrics.draft_worker_state(self.client.generation, self.client.worker_drafted, self.client.arena_bytes,
                                        len(lookup.entries) if lookup else 0, suffix.tokens if suffix else 0)

    def step_result(self, step: DecodeStep, logits_output, accepted: AcceptRows,
                    new_seq_lens: torch.Tensor) -> GenerationBatchResult:
        cap_lens, block_accept_lens = result_counts(step.drafted, step.rows.sizes)
        return GenerationBatchResult(
            cap_lens=cap_lens.to(self.device), block_accept_lens=block_accept_lens.to(self.device),
            logits_output=logits_output, next_token_ids=accepted.tokens.flatten().to(self.device),
            accept_lens=accepted.accept_lens.to(self.device), new_seq_lens=new_seq_lens,
            next_draft_input=self.relay(new_seq_lens, accepted.tokens, accepted.accept_lens),
            can_run_cuda_graph=False, speculative_num_draft_tokens=self.stride)

    def draft_failed(self, exc: DraftWorkerUnavailable) -> None:
        """Counted per cause on /metrics and logged once per cause and log window (sgl_dspark.observe)."""
        self.metrics.draft_worker_failed(exc.cause, str(exc))

    def draft_ahead(self, reqs: list[StepRequest], accepted: AcceptRows) -> None:
        """The next step's drafting starts now, on the draft worker's core, while this process finishes the step
        (the request set may change before then: the worker keeps only drafts whose request key still matches).
        `accepted`: the verdict on the host."""
        lens = accepted.accept_lens.long()
        anchors = accepted.tokens[torch.arange(lens.shape[0]), lens - 1].tolist()  # each request's bonus token
        try:
            self.client.draft_ahead(draft_batch(reqs, [r.seq_len + n for r, n in zip(reqs, lens.tolist())], anchors))
        except DraftWorkerUnavailable as exc:
            self.draft_failed(exc)

    def custom_logits(self, batch, step: DecodeStep, logits: torch.Tensor) -> None:
        """Custom logit processors (SGLang's objects) on the root rows of their requests, which verify that row
        alone."""
        if batch.sampling_info.has_custom_logit_processor:
            from sglang.srt.layers.sampler import apply_custom_logit_processor

            width = step.rows.width
            roots = logits[::width].clone()
            apply_custom_logit_processor(roots, batch.sampling_info)
            logits[::width] = roots

    @staticmethod
    def logprobs(batch, logits_output, accepted, width: int) -> None:
        """Log probabilities of the emitted tokens from the verify forward's logits of the rows that predicted
        them (the root and the accepted path), as SGLang's speculative workers compute them."""
        from sglang.srt.layers.logprob_processor import compute_spec_logprobs

        index = accepted.accept_index
        predict = torch.zeros(index.shape[0] * width, dtype=torch.long, device=index.device)
        kept = index >= 0
        predict[index[kept]] = accepted.tokens[:, :width][kept]
        compute_spec_logprobs(batch, logits_output, predict, accept_index=index)

    def commit(self, batch, done: StepOutcome) -> torch.Tensor:
        """Keep the accepted path's KV at the front of each request's verify window (moving only rows not already
        there: a chain's accepted path always is), give the drafter those rows' features at their final slots;
        -> the new sequence lengths."""
        commit, loc = done.commit, batch.out_cache_loc
        hidden = done.verified.hidden
        self.write_context(loc[commit.front.to(loc.device)], commit.positions, hidden[commit.kept.to(hidden.device)])
        if commit.move_dst.numel():
            kv = self.token_to_kv_pool_allocator.get_kvcache()
            kv.move_kv_cache(loc[commit.move_dst.to(loc.device)], loc[commit.move_src.to(loc.device)])
        accept_lens = done.verdict.rows.accept_lens
        return batch.seq_lens + accept_lens.to(batch.seq_lens.device).to(batch.seq_lens.dtype)

    def relay(self, seq_lens: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor) -> NgramVerifyInput:
        """The running batch's spec state between steps (SGLang filters/merges it as requests come and go)."""
        return NgramVerifyInput(draft_token_num=self.stride, new_seq_lens=seq_lens,
                                accept_tokens=tokens.flatten().to(self.device), accept_lens=lens.to(self.device))
