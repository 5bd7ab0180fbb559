"""Audit of SGLang 0.5.23's own references to the name DSPARK, and how each is kept from applying builtin rules to us.

Our spec object answers `is_dspark()` / `is_dflash_family()` with False (algorithm.py), so the ~60 predicate
call sites skip builtin DSPARK code. What remains are comparisons of the raw string (and enum member) below.
None needs a code patch on the configurations we serve; the ones that would apply builtin-only rules are
neutralised by refusing, at start-up, the feature that gates them (UNSUPPORTED, checked by server_args.py).
`tests/unit/test_patches.py` rescans SGLang and fails when the sites change (new sites must be audited here).

| site (sglang/srt/...)                                        | decision                                            |
|--------------------------------------------------------------|-----------------------------------------------------|
| arg_groups/speculative_hook.handle_speculative_decoding (x3) | refused: disaggregation, block verification,        |
|                                                              | DP spec/prefill coordination (R-disagg/R-block/R-dp)|
| arg_groups/speculative_hook <module> _DSPARK_DRAFT_SUBFOLDER | builtin-only: read by _handle_dspark, never reached |
| arg_groups/validation_hook.check_pipeline_parallel_compat    | refused: pp_size > 1 (R-pp)                         |
| arg_groups/validation_hook <module> aux capture methods      | harmless: capture-only mode turns speculation off;  |
|                                                              | server_args.py steps aside in that mode             |
| arg_groups/kv_cache_hook.handle_kv4_compatibility            | harmless: SM100 NVFP4 KV only, and it refuses us    |
| arg_groups/kv_cache_hook.handle_unified_memory_pool (x3)     | refused: --enable-unified-memory (R-unified)        |
| arg_groups/lora_hook.check_lora_speculative_compatibility x2 | refused: LoRA (R-lora); it assumes the builtin's    |
|                                                              | uniform verify width, ours is per request           |
| arg_groups/hicache_hook.resolve_hicache_dcp_compatibility    | refused: --dcp-size > 1 (R-dcp)                     |
| arg_groups/attention_hook.handle_linear_attn_backend         | refused: --enable-linear-replayssm-spec (R-kda)     |
| mem_cache/kv_cache_configurator._build_hybrid_req_pool       | refused: --enable-linear-replayssm-spec (R-kda)     |
| disaggregation/utils.get_dsv41_spec_layout                   | refused: disaggregation (R-disagg)                  |
| arg_groups/deepseek_v4_hook (x2), kimi_k3_hook,              | harmless: GPU-only target families (DeepSeek-V4,    |
| model_overrides/{kimi_k3 x2, minimax_m3 x4, nemotron_h x2}   | Kimi-K3, MiniMax-M3, Nemotron-H on SM100/Blackwell);|
|                                                              | they fill speculative_draft_attention_backend (our  |
|                                                              | worker ignores it) or backends only when unset      |
|                                                              | (ours is declared before they run)                  |
| configs/model_config.ModelConfig._config_draft_model (x2)    | harmless: MiniMax / DeepSeek-V4 draft architectures |
|                                                              | only, and only for an SGLang-built draft ModelConfig|
|                                                              | (EAGLE paths; carries_draft_hidden_states is False) |
| model_runner_components/spec_aux_hidden_state ("dspark")     | harmless: capture-only mode, speculation off        |
| speculative/spec_utils.spec_need_hidden_states               | relies on it: False for "DSPARK" is right for us    |
|                                                              | (the worker relays no hidden states via FutureMap)  |
| managers/scheduler_components/metrics_reporter <module>      | harmless: enum member; our object is not in the     |
|                                                              | builtin spec-decode snapshot tuple                  |
| speculative/spec_info.SpeculativeAlgorithm.{is_dspark,      | builtin-only: enum methods; DSparkSpec answers them |
| supports_mixed_chunk}                                        | itself (algorithm.DECISIONS)                        |
| speculative/dspark_components/* (x3)                         | builtin-only: the builtin worker, never created     |
"""

import ast
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Refusal:
    key: str  # short id used in the table above
    flag: str  # what the user passed, as they spelled it
    applies: Callable[[Any], bool]  # resolving view of the server args -> refused?
    why: str


def _dp_spec_coordination(cfg: Any) -> bool:
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION.get())


UNSUPPORTED = (
    Refusal("R-pp", "--pp-size > 1", lambda c: c.pp_size != 1,
            "SGLang treats pipeline-parallel DSPARK as the builtin PD-prefill pipeline"),
    Refusal("R-disagg", "--disaggregation-mode", lambda c: c.disaggregation_mode != "null",
            "the prefill/decode transfer is the builtin worker's layout"),
    Refusal("R-unified", "--enable-unified-memory", lambda c: bool(c.enable_unified_memory),
            "the unified pool's DSPARK rules are the builtin worker's"),
    Refusal("R-lora", "--enable-lora / --lora-paths", lambda c: bool(c.enable_lora) or bool(c.lora_paths),
            "SGLang's LoRA layout assumes a uniform verify width per request"),
    Refusal("R-block", "--speculative-use-block-verification", lambda c: bool(c.speculative_use_block_verification),
            "verification is the plugin's own (sgl_dspark.verify)"),
    Refusal("R-dcp", "--dcp-size > 1", lambda c: c.dcp_size != 1,
            "decode context parallelism is the builtin worker's"),
    Refusal("R-kda", "--enable-linear-replayssm-spec", lambda c: bool(c.enable_linear_replayssm_spec),
            "the KDA fold commit is the builtin worker's"),
    Refusal("R-dp", "SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION=1", _dp_spec_coordination,
            "DP spec/prefill coordination is the builtin worker's"),
    Refusal("R-adaptive", "--speculative-adaptive", lambda c: bool(c.speculative_adaptive),
            "the plugin's scheduler chooses the verify budget itself"),
    Refusal("R-dp-attn", "--enable-dp-attention", lambda c: bool(c.enable_dp_attention),
            "DP attention runs idle batches through the worker, which DSPARK does not support"),
    Refusal("R-hidden", "--enable-return-hidden-states / --return-hidden-states-mode",
            lambda c: bool(c.enable_return_hidden_states) or c.return_hidden_states_mode not in (None, "none"),
            "the verify step's hidden states are not returned per accepted token"),
)
# ServerArgs fields the refusals read (checked for drift by server_args.py).
REFUSAL_FIELDS = ("pp_size", "disaggregation_mode", "enable_unified_memory", "enable_lora", "lora_paths",
                  "speculative_use_block_verification", "dcp_size", "enable_linear_replayssm_spec",
                  "speculative_adaptive", "enable_dp_attention",
                  "enable_return_hidden_states", "return_hidden_states_mode")

# (file under sglang/, enclosing function or "<module>") -> number of DSPARK references, as audited above.
SITES = {
    ("srt/arg_groups/attention_hook.py", "handle_linear_attn_backend"): 1,
    ("srt/arg_groups/deepseek_v4_hook.py", "apply_deepseek_v4_defaults"): 1,
    ("srt/arg_groups/deepseek_v4_hook.py", "validate_deepseek_v41_features"): 1,
    ("srt/arg_groups/hicache_hook.py", "resolve_hicache_dcp_compatibility"): 1,
    ("srt/arg_groups/kimi_k3_hook.py", "apply_kimi_k3_spec_backend_defaults"): 1,
    ("srt/arg_groups/kv_cache_hook.py", "handle_kv4_compatibility"): 1,
    ("srt/arg_groups/kv_cache_hook.py", "handle_unified_memory_pool"): 3,
    ("srt/arg_groups/lora_hook.py", "check_lora_speculative_compatibility"): 2,
    ("srt/arg_groups/model_overrides/kimi_k3.py", "_kimi_k3_overrides"): 2,
    ("srt/arg_groups/model_overrides/minimax_m3.py", "_minimax_m3_overrides"): 4,
    ("srt/arg_groups/model_overrides/nemotron_h.py", "_nemotron_h_overrides"): 2,
    ("srt/arg_groups/speculative_hook.py", "handle_speculative_decoding"): 3,
    ("srt/arg_groups/speculative_hook.py", "<module>"): 1,
    ("srt/arg_groups/validation_hook.py", "check_pipeline_parallel_compat"): 1,
    ("srt/arg_groups/validation_hook.py", "<module>"): 1,
    ("srt/configs/model_config.py", "ModelConfig._config_draft_model"): 2,
    ("srt/disaggregation/utils.py", "get_dsv41_spec_layout"): 1,
    ("srt/managers/scheduler_components/metrics_reporter.py", "<module>"): 1,
    ("srt/mem_cache/kv_cache_configurator.py", "KVCacheConfigurator._build_hybrid_req_pool"): 1,
    ("srt/model_executor/model_runner_components/spec_aux_hidden_state.py",
     "_resolve_capture_only_aux_hidden_state"): 1,
    ("srt/speculative/dspark_components/dspark_draft.py", "DraftBlockProposer._run_forward"): 1,
    ("srt/speculative/dspark_components/dspark_draft.py", "DraftBlockProposer.run_idle_participation"): 1,
    ("srt/speculative/dspark_components/dspark_worker_v2.py", "DSparkWorkerV2.__init__"): 1,
    ("srt/speculative/spec_info.py", "SpeculativeAlgorithm.is_dspark"): 1,
    ("srt/speculative/spec_info.py", "SpeculativeAlgorithm.supports_mixed_chunk"): 1,
    ("srt/speculative/spec_utils.py", "spec_need_hidden_states"): 1,
}


def dspark_references(sglang_root: Path) -> Counter:
    """(file, enclosing function) -> count of "DSPARK"/"dspark" literals and `SpeculativeAlgorithm.DSPARK` uses
    in SGLang's runtime sources (tests excluded)."""
    found: Counter = Counter()
    for path in sorted((sglang_root / "srt").rglob("*.py")):
        rel = path.relative_to(sglang_root).as_posix()
        text = path.read_text(errors="replace")
        if "/test" in rel or "DSPARK" not in text.upper():
            continue
        for scope in _references(ast.parse(text), []):
            found[(rel, scope)] += 1
    return found


def _references(node: ast.AST, scope: list[str]):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _references(child, scope + [child.name])
            continue
        literal = isinstance(child, ast.Constant) and isinstance(child.value, str) and child.value.upper() == "DSPARK"
        member = (isinstance(child, ast.Attribute) and child.attr == "DSPARK"
                  and isinstance(child.value, ast.Name) and child.value.id == "SpeculativeAlgorithm")
        if literal or member:
            yield ".".join(scope) or "<module>"
        yield from _references(child, scope)
