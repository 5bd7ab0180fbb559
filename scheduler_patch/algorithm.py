"""The name DSPARK: `SpeculativeAlgorithm.from_string("DSPARK")` (any case) returns this plugin's spec object.

Patch `dspark.from_string` takes the builtin name over, so SGLang's builtin DSPARK handling (CUDA-only argument
checks, its worker) never runs. `DSparkSpec` answers every question SGLang 0.5.23 asks a spec algorithm; each
answer and its reason is in DECISIONS, and an upstream method not listed there is drift. Must not resolve server
arguments (server_args.py) or run the algorithm (runtime/worker.py).
"""

import logging
import types

from sglang.srt.speculative.spec_info import CustomSpecAlgo  # re-exported; spec_registry is internal

from scheduler_patch.launch import NAME, launch_of
from scheduler_patch.patches import Patch

WORKER = "scheduler_patch.runtime.worker.DSparkWorker"  # imported only when the scheduler creates the worker
SPEC_INFO = "sglang.srt.speculative.spec_info"
logger = logging.getLogger(__name__)

# Every method SGLang's SpeculativeAlgorithm offers, and what ours answers. The builtin DSPARK predicates stay
# False so no builtin-only rule (ragged-verify CUDA graphs, confidence relay, DFlash hidden-state capture, its
# disaggregation input, its worker) is applied to us.
DECISIONS = {
    "is_some": "True (base)",
    "is_none": "False (base)",
    "is_speculative": "True (base): the scheduler takes its speculative paths",
    "is_eagle": "False (base)",
    "is_eagle3": "False (base)",
    "is_frozen_kv_mtp": "False (base)",
    "is_dflash": "False (base)",
    "is_uno": "False (base)",
    "is_dspark": "False (base): the builtin DSPARK rules are for the builtin worker, not ours",
    "is_dflash_family": "False (base): no DFlash aux-hidden capture or DFlashVerifyInput; the worker captures",
    "is_standalone": "False (base)",
    "is_ngram": "False (base)",
    "supports_target_verify_for_draft": "False (base): the drafter does not run in SGLang's model runner",
    "supports_prefill_shared_read_done": "False (base): the conservative answer",
    "supports_mixed_chunk": "False (base): server_args declares enable_mixed_chunk=False",
    "supports_ragged_verify": "False (base): SGLang's ragged-verify graphs are the builtin worker's layout",
    "supports_grammar_overlap": "False (base): no overlap scheduling",
    "has_draft_kv": "False: draft state lives in the worker, not SGLang's KV pool; the per-decode reserve is "
                    "max(steps * topk, num_draft_tokens) = the verify tokens per request",
    "carries_draft_hidden_states": "False: disaggregation is refused",
    "create_future_map": "the builtin FutureMap: the scheduler always builds one (it relays input ids)",
    "build_disagg_draft_input": "None (base): disaggregation is refused",
    "need_topk": "False: no EAGLE top-k relay",
    "handle_server_args": "re-declares the launch fields server_args.py prepared (last writer wins)",
    "resolve_max_speculative_num_draft_tokens": "base: speculative_num_draft_tokens, fixed for the run",
    "get_num_tokens_per_req_for_target_verify": "base: num_draft_tokens",
    "get_platform_worker_cls": "None: an out-of-tree platform's worker for the builtin DSPARK must not replace ours",
    "create_worker": f"{WORKER}, imported lazily; refuses overlap scheduling",
}
_ENUM_ONLY = ("from_string", "register")  # classmethods of the enum itself, not asked of an algorithm object


class DSparkSpec(CustomSpecAlgo):
    """The DSPARK algorithm as this plugin runs it (no overlap scheduling; see DECISIONS)."""

    def __init__(self) -> None:
        super().__init__(NAME, _worker_class, supports_overlap=False)

    def __repr__(self) -> str:
        return f"DSparkSpec({self.name!r}, plugin=sgl-dspark)"

    def has_draft_kv(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self):
        return None

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def handle_server_args(self, server_args) -> None:
        """Runs inside SGLang's handle_speculative_decoding on a recorder whose field writes become declarations."""
        for name, value in launch_of(server_args).server_fields().items():
            setattr(server_args, name, value)

    def create_worker(self, server_args) -> type:
        from sglang.srt.arg_groups.overrides import resolving_view

        if not resolving_view(server_args).disable_overlap_schedule:
            raise ValueError("sgl-dspark: DSPARK does not support overlap scheduling (disable_overlap_schedule is "
                             "False; the plugin's server-args handling did not run)")
        logger.info("sgl-dspark: creating the DSPARK worker with %s", launch_of(server_args))
        return self.factory(server_args)


def _worker_class(server_args) -> type:
    from scheduler_patch.runtime.worker import DSparkWorker

    return DSparkWorker


_SPEC: DSparkSpec | None = None


def spec() -> DSparkSpec:
    """This process's one DSPARK spec object (SGLang compares spec objects by identity)."""
    global _SPEC
    if _SPEC is None:
        _SPEC = DSparkSpec()
    return _SPEC


def undecided_methods() -> str | None:
    """SpeculativeAlgorithm methods with no entry in DECISIONS (new upstream questions), or None."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    offered = {name for name, value in vars(SpeculativeAlgorithm).items()
               if not name.startswith("_") and isinstance(value, (types.FunctionType, classmethod, staticmethod))}
    new = sorted(offered - set(DECISIONS) - set(_ENUM_ONLY))
    missing = sorted(name for name in DECISIONS if not callable(getattr(DSparkSpec, name, None)))
    if new:
        return f"{SPEC_INFO}.SpeculativeAlgorithm has methods with no DSpark decision: {new}"
    if missing:
        return f"DSparkSpec lacks {missing} (CustomSpecAlgo changed)"
    return None


def _from_string(original, name):
    if isinstance(name, str) and name.upper() == NAME:
        return spec()
    return original(name)


FROM_STRING = Patch("dspark.from_string", f"{SPEC_INFO}.SpeculativeAlgorithm.from_string", "classmethod",
                    ("cls", "name"), _from_string, requires=undecided_methods)
PATCHES = (FROM_STRING,)
