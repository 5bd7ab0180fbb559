"""What the SGLang worker is built from, assembled once at start-up from the launch record and the target.

Owns: the drafter bound to the target's embedding/LM head, the target-side feature capture, the draft client, the
step-cost table and the verify budget. Resolves nothing the launch record (scheduler_patch/launch.py) holds:
the config, the drafter's config, the knobs and the verify width come from it. Errors name their cause.
Reaches into SGLang's model runner and model (their capture hooks, layers, pools); the algorithm it assembles
comes from sgl_dspark.
"""

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass

import psutil
import torch

from sgl_dspark.config import DSparkKnobs
from sgl_dspark.cost import StepCostTable, from_measurements
from sgl_dspark.draft_worker.client import DraftClient
from sgl_dspark.drafter import TargetSpec, TargetWeights
from sgl_dspark.observe import WorkerMetrics
from sgl_dspark.packed_gemm import KERNEL_ROWS, KernelTimes, cpu_bf16_fast, onednn_available, pack_drafter
from sgl_dspark.budget import BudgetPolicy, make_budget
from sgl_dspark.streams import DRAFT, stream_seed

from scheduler_patch.launch import DSparkLaunch
from scheduler_patch.runtime.profiler import SavingBudget, startup_table
from scheduler_patch.runtime.tensor_parallel import tp_group, whole_vocab
from scheduler_patch.target_gemm import ROWS, pack_target

logger = logging.getLogger("sgl_dspark")

# Until the table is profiled at start-up (and if profiling fails), the step cost grows ~8% per verified token
# (measured on CPU: verifying 8 tokens costs ~1.6x a plain step); the online refit then corrects it.
PRIOR_TOKENS = (1, 2, 4, 8, 16, 32, 64)
PRIOR_SLOPE = 0.08
PRIOR_STEP_S = 0.07


@dataclass(frozen=True)
class WorkerSetup:
    launch: DSparkLaunch  # everything the main process resolved (config, drafter config, knobs, verify width)
    target_path: str
    target: TargetSpec
    target_weights: TargetWeights  # the running target's own tensors (used only by the in-process client)
    budget: BudgetPolicy
    kernels: KernelTimes | None = None  # plain SGLang's GEMM kernel timed against the target's packed one (CPU)

    @property
    def config(self) -> DSparkKnobs:
        return self.launch.config

    def make_client(self, num_slots: int, random_seed: int) -> DraftClient:
        """The drafter in SGLang's process (the default), or with draft_process=true in a worker process; either
        draws from the drafter's own stream of --random-seed (sgl_dspark.streams), never the verifier's."""
        launch = self.launch
        if not self.config.draft_process:
            from sgl_dspark.draft_worker.local import GuardedDraftClient, LocalDraftClient
            from sgl_dspark.drafter import load_drafter

            dtype = getattr(torch, self.draft_dtype(self.device))
            # the drafter runs on the target's device and borrows the target's own tables there (no copy): it
            # casts the rows it looks up, and keeps only its draft vocabulary's LM-head rows in its own dtype
            drafter = load_drafter(launch.drafter_path, self.target, self.target_weights, dtype, self.device)
            if self.device.type == "cpu" and self.config.cpu_gemm == "onednn" and onednn_available():
                pack_drafter(drafter)
            return GuardedDraftClient(LocalDraftClient(drafter, launch.draft_knobs, num_slots,
                                                        stream_seed(random_seed, DRAFT)))
        from sgl_dspark.draft_worker.remote import ProcessDraftClient, WorkerSettings

        gemm = self.config.cpu_gemm if onednn_available() else "native"  # the kernel only: same drafts
        dtype = self.draft_dtype(torch.device("cpu"))  # the worker process drafts on the CPU
        return ProcessDraftClient(WorkerSettings(launch.drafter_path, self.target_path, self.target,
                                                 launch.draft_knobs, num_slots, seed=random_seed,
                                                 dtype=dtype, gemm=gemm, drafter_config=launch.drafter))

    @property
    def device(self) -> torch.device:
        """Where the target's weights are: the in-process drafter runs there too."""
        return self.target_weights.embed.device

    def draft_dtype(self, device: torch.device) -> str:
        """The draft_dtype knob, "auto" resolved for the drafter's device: bfloat16 on an accelerator, and on a CPU
        that runs it fast."""
        if self.config.draft_dtype != "auto":
            return self.config.draft_dtype
        return "bfloat16" if device.type != "cpu" or cpu_bf16_fast() else "float32"


def prior_cost_table() -> StepCostTable:
    return from_measurements(PRIOR_TOKENS, [PRIOR_STEP_S * (1 + PRIOR_SLOPE * (b - 1)) for b in PRIOR_TOKENS])


def target_weights(model, vocab: int, tp_group=None) -> TargetWeights:
    """The target's embedding and LM head, whole (under tensor parallelism gathered from the ranks' shards); a
    table read from its packed copy (scheduler_patch/target_gemm.py) is borrowed as that."""
    try:
        embed, head = (vars(m).get(ROWS, m.weight) for m in (model.model.embed_tokens, model.lm_head))
    except AttributeError as exc:
        raise ValueError(f"sgl-dspark: cannot find the embedding / LM head of {type(model).__name__}") from exc
    whole = whole_vocab(embed, vocab, tp_group)
    return TargetWeights(whole, whole if head is embed else whole_vocab(head, vocab, tp_group))


def capture_target_features(model, layer_ids: tuple[int, ...], num_layers: int) -> None:
    """Ask the target to return the hidden states the drafter reads, through SGLang's per-model capture hooks
    (the DSpark one where a model has it, else the DFlash one; both capture the outputs of `layer_ids`)."""
    if hasattr(model, "set_dspark_layers_to_capture"):
        model.set_dspark_layers_to_capture(list(layer_ids))
        return
    if type(model).__name__ == "Gemma3ForCausalLM":
        capture_gemma3_residual_stream(model, layer_ids)
        return
    if not hasattr(model, "set_dflash_layers_to_capture"):
        raise ValueError(f"target model {type(model).__name__} has no SGLang hidden-state capture for DSpark")
    if max(layer_ids) >= num_layers - 1:  # the DFlash hook captures layer i's output as layer i+1's input
        raise ValueError(f"drafter target_layer_ids {list(layer_ids)}: {type(model).__name__} captures layer "
                         f"outputs only below its last layer ({num_layers - 1})")
    model.set_dflash_layers_to_capture(list(layer_ids))


def capture_gemma3_residual_stream(model, layer_ids: tuple[int, ...]) -> None:
    """Gemma-3 has only the EAGLE-3 hook, which captures a layer's input as SGLang's Gemma-3 passes it: the MLP
    delta of the layer before, with the residual stream carried apart. Each captured layer is made to hand on
    (delta + residual, 0) instead: the next layer's fused add then sees the same sum (x + 0 is exact, so outputs do
    not change) and the hook captures the residual stream, as the drafter was trained on."""
    for i in layer_ids:
        layer = model.model.layers[i]
        if getattr(layer, "_dspark_sums_residual", False):
            continue
        inner = layer.forward

        def summed(*args, _inner=inner, **kwargs):
            hidden, residual = _inner(*args, **kwargs)
            return hidden + residual, torch.zeros_like(residual)

        layer.forward, layer._dspark_sums_residual = summed, True
    model.set_eagle3_layers_to_capture(list(layer_ids))


def use_packed_gemm(model, timed: bool) -> KernelTimes | None:
    """The target's linear layers and LM head on oneDNN packed weights (scheduler_patch/target_gemm.py); timed:
    plain SGLang's kernel against the packed one, for the gate's baseline (plain SGLang's step on this hardware)."""
    if not onednn_available():
        raise ValueError("--speculative-dspark-cpu-gemm onednn: this torch build has no oneDNN; "
                         "set --speculative-dspark-cpu-gemm native")
    # the tied table read from the packed head, but under tensor parallelism, whose drafter gathers the shards
    report = pack_target(model, getattr(model, "lm_head", None), KERNEL_ROWS if timed else (),
                         rows_from_copy=tp_group() is None)
    logger.info("sgl-dspark: %d target linear layers on oneDNN packed weights (%.0f MB freed, %.0f MB added, "
                "%.0f MB read from the packed copy instead of a table of their own)", report.layers,
                report.freed_bytes / 2**20, report.added_bytes / 2**20, report.shared_bytes / 2**20)
    if report.kernels is not None:
        logger.info("sgl-dspark: the target's linear layers, one pass, %s; the gate speculates only where it beats "
                    "the faster of this server's step without drafts and plain SGLang's step",
                    report.kernels.describe())
    return report.kernels


def log_interval(server_args) -> int:
    """Decode steps per log line (SGLang's --decode-log-interval): also how often a refitted cost table is saved."""
    return int(getattr(server_args, "decode_log_interval", 40) or 40)


def worker_metrics(server_args, plans: bool = True) -> WorkerMetrics:
    """The worker's counters and log line; DSpark's Prometheus series only with --enable-metrics and on the rank that
    plans (under TP the other ranks never draft), labelled as SGLang labels its own: the served model's name, and
    the replica's rank under data parallelism (each replica's draft worker, lookup and suffix cache are its own)."""
    labels = None
    if getattr(server_args, "enable_metrics", False) and plans:
        from sglang.srt.runtime_context import get_parallel

        labels = {"model_name": str(getattr(server_args, "served_model_name", None) or server_args.model_path)}
        if (dp_rank := get_parallel().dp_rank) is not None:
            labels["dp_rank"] = str(dp_rank)
    return WorkerMetrics.create(log_interval(server_args), labels)


def precision_note(dtype: torch.dtype) -> str | None:
    """The start-up line for a target served below float32, where greedy output is plain's up to ties in that
    precision (None in float32). SGLang's --dtype auto serves a float32 checkpoint in float16 (bfloat16 for Gemma)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"sgl-dspark: the target runs in {name}: greedy output equals plain SGLang's token for token in float32 "
            f"(--dtype float32); in {name} the verify forward's rows round differently from plain's one row, so a "
            "near-tie between two tokens can break the other way (docs/serving.md, what lossless means)")


def build_setup(launch: DSparkLaunch, server_args, model_runner) -> WorkerSetup:
    config = launch.config
    if note := precision_note(model_runner.model_config.dtype):
        logger.info(note)
    target = TargetSpec.from_hf_config(model_runner.model_config.hf_config.to_dict())
    model = model_runner.model
    capture_target_features(model, launch.drafter.target_layer_ids, target.num_hidden_layers)
    kernels = None
    if str(model_runner.device) == "cpu" and config.cpu_gemm == "onednn":
        kernels = use_packed_gemm(model, timed=config.gate and config.drafts)
    table = launch.cost_table or prior_cost_table()
    budget = make_budget(config, table)
    if config.cost_table_out:
        budget = SavingBudget(budget, table, config.cost_table_out, log_interval(server_args),
                                    {"model": server_args.model_path, "device": str(model_runner.device)})
    weights = target_weights(model, int(model_runner.model_config.vocab_size), tp_group())
    return WorkerSetup(launch, server_args.model_path, target, weights, budget, kernels)


def start_cost_table(setup: WorkerSetup, model_runner) -> None:
    """Once SGLang has made the KV pools and attention backends: give the verify budget a table profiled on this
    hardware (unless one was given, or nothing would use or save it); with cost_table_out, save the table."""
    config, budget = setup.config, setup.budget
    table = getattr(budget, "cost_table", None) or prior_cost_table()
    if not config.cost_table and (config.budget != "off" or config.cost_table_out):
        group = tp_group()
        table = startup_table(model_runner, setup.launch.verify_tokens, table, 1 if group is None else group.world_size)
    if hasattr(budget, "cost_table"):  # the "off" budget has none (unless wrapped to save one)
        budget.cost_table = table


def release_freed_memory() -> int:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim) once start-up is over: loading the drafter
    (its checkpoint decompressed, cast) and packing the target's weights (the originals dropped) free memory in the
    middle of the heap, which glibc keeps otherwise. Returns the bytes the process's RSS fell by (0 where the C
    library is not glibc)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "malloc_trim"):
        return 0
    before = psutil.Process().memory_info().rss
    libc.malloc_trim(0)
    return max(0, before - psutil.Process().memory_info().rss)
