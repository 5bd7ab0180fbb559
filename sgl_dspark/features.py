"""Which request features DSPARK serves exactly and which it refuses, field by field.

Owns the classification of every field of SGLang's SamplingParams and GenerateReqInput (a unit test fails when
SGLang adds a field nobody classified) and `refusal`, the one-line reason a request is refused. A refused request
gets HTTP 400 with that line; it is never served with changed output. Pure: reads attributes by name, never
imports SGLang.

Kinds: "served" (exact: verification reproduces what plain decoding does with it), "inert" (does not change
which tokens are generated: transport, detokenization, accounting, or refused at start-up), "refused".
"""

from dataclasses import dataclass
from typing import Any

SERVED, INERT, REFUSED = "served", "inert", "refused"


@dataclass(frozen=True)
class Feature:
    kind: str
    why: str
    off: Any = None  # for a refused field: the value that means "not used" (anything else is refused)


def _refused(why: str, off: Any = None) -> Feature:
    return Feature(REFUSED, why, off)


_PENALTY = "applied to each verify row with the counts of the output plus the draft path (sgl_dspark.constraints)"
_GRAMMAR = "each verify row masked by the grammar's state after its draft path (sgl_dspark.constraints)"

SAMPLING_FIELDS: dict[str, Feature] = {
    "max_new_tokens": Feature(SERVED, "SGLang trims the accepted tokens at the limit"),
    "stop": Feature(SERVED, "SGLang checks every emitted token and trims after a stop"),
    "stop_token_ids": Feature(SERVED, "as stop"),
    "stop_regex": Feature(SERVED, "as stop"),
    "stop_strs": Feature(SERVED, "as stop"),
    "stop_regex_strs": Feature(SERVED, "as stop"),
    "stop_str_max_len": Feature(INERT, "internal (stop matching)"),
    "stop_regex_max_len": Feature(INERT, "internal (stop matching)"),
    "temperature": Feature(SERVED, "the verifier's target distribution (sgl_dspark.sampling)"),
    "top_p": Feature(SERVED, "the verifier's target distribution"),
    "top_k": Feature(SERVED, "the verifier's target distribution"),
    "min_p": Feature(SERVED, "the verifier's target distribution"),
    "frequency_penalty": Feature(SERVED, _PENALTY),
    "presence_penalty": Feature(SERVED, _PENALTY),
    "repetition_penalty": Feature(SERVED, _PENALTY),
    "min_new_tokens": Feature(SERVED, "stop tokens masked on the verify rows whose output is still shorter"),
    "n": Feature(SERVED, "SGLang runs n separate requests"),
    "beam_width": _refused("beam search is not speculative decoding", None),
    "json_schema": Feature(SERVED, _GRAMMAR),
    "regex": Feature(SERVED, _GRAMMAR),
    "ebnf": Feature(SERVED, _GRAMMAR),
    "structural_tag": Feature(SERVED, _GRAMMAR),
    "ebnf_full_assistant": Feature(SERVED, "part of the ebnf grammar"),
    "ignore_eos": Feature(SERVED, "SGLang's stop checks on every emitted token"),
    "skip_special_tokens": Feature(INERT, "detokenization"),
    "spaces_between_special_tokens": Feature(INERT, "detokenization"),
    "no_stop_trim": Feature(INERT, "detokenization"),
    "stream_interval": Feature(INERT, "streaming"),
    "logit_bias": Feature(SERVED, "added to every verify row, after the grammar mask as plain decoding does"),
    "sampling_seed": Feature(SERVED, "SGLang's seeded Gumbel-max choice per verify row, matched exactly"),
    "custom_params": Feature(SERVED, "passed to the custom logit processor with the row plain decoding gives it"),
    "watermark": _refused("watermarking biases sampling per row; not applied to verify rows"),
    "is_normalized": Feature(INERT, "internal"),
}

# GenerateReqInput fields. The refused ones are checked on the scheduler's Req under the attribute named in `off`'s
# place: REQUEST_CHECKS maps Req attribute -> the request field it comes from.
REQUEST_FIELDS: dict[str, Feature] = {
    **{name: Feature(INERT, "routing, transport or accounting") for name in (
        "rid", "session_id", "text", "input_ids", "sampling_params", "stream", "log_metrics", "bootstrap_host",
        "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
        "data_parallel_rank", "disagg_prefill_dp_rank", "routing_key", "conversation_id", "http_worker_ipc",
        "background", "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_prompt_token_ids",
        "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned", "cache_salt",
        "kv_hints", "session_params", "return_text_in_logprobs", "modalities")},
    **{name: Feature(SERVED, "from the verify forward's logits of the accepted rows (SGLang's compute_spec_logprobs)")
       for name in ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                    "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
                    "return_flat_raw_top_logprobs_b64")},
    "watermark": _refused("watermarking biases sampling per row; not applied to verify rows"),
    "return_hidden_states": _refused("the verify step's hidden states are not returned per accepted token"),
    "return_routed_experts": _refused("routed experts of verify rows are not returned"),
    "routed_experts_start_len": Feature(INERT, "only with return_routed_experts (refused)"),
    "return_indexer_topk": _refused("indexer top-k of verify rows is not returned"),
    "return_sampling_mask": _refused("sampling masks of verify rows are not returned"),
    "sampling_logprobs_mode": Feature(INERT, "only with return_sampling_mask (refused)"),
    "return_entropy": _refused("entropies of verify rows are not returned"),
    "custom_logit_processor": Feature(SERVED, "its request verifies the anchor alone (no drafts), so the processor "
                                              "sees the one row plain decoding gives it, with the same request state"),
    "require_reasoning": _refused("reasoning grammars are not applied to verify rows"),
    "max_thinking_tokens": _refused("the thinking budget's logit processing is not applied to verify rows"),
    "lora_path": _refused("LoRA is refused at start-up with DSPARK"),
    "lora_id": _refused("LoRA is refused at start-up with DSPARK"),
    **{name: _refused("multimodal and embedding inputs are not drafted for") for name in (
        "input_embeds", "image_data", "video_data", "audio_data", "positional_embed_overrides")},
    **{name: Feature(INERT, "only with multimodal inputs (refused)") for name in (
        "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config", "encoder_urls", "max_dynamic_patch",
        "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
        "mm_processor_kwargs")},
    **{name: Feature(INERT, "scoring and pooling requests do not decode") for name in (
        "multi_item_delimiter_indices", "token_indices_to_pool")},
}

# Scheduler-side Req attribute -> request field, for the refused request fields the Req carries.
REQ_ATTRIBUTES = {
    "return_hidden_states": "return_hidden_states", "return_routed_experts": "return_routed_experts",
    "return_indexer_topk": "return_indexer_topk", "return_sampling_mask": "return_sampling_mask",
    "return_entropy": "return_entropy",
    "require_reasoning": "require_reasoning", "max_thinking_tokens": "max_thinking_tokens",
    "input_embeds": "input_embeds", "multimodal_inputs": "image_data",
    "positional_embed_overrides": "positional_embed_overrides",
}


def used_refused(sampling: Any, req: Any) -> list[str]:
    """The refused fields a request uses: sampling params (SGLang's SamplingParams) and Req attributes."""
    given = [name for name, f in SAMPLING_FIELDS.items()
             if f.kind == REFUSED and getattr(sampling, name, f.off) not in (f.off, None)]
    given += [field for attr, field in REQ_ATTRIBUTES.items() if getattr(req, attr, None) not in (None, False)]
    if getattr(sampling, "sampling_seed", None) is not None and getattr(sampling, "min_p", 0.0) > 0.0:
        given.append("sampling_seed with min_p")  # SGLang's seeded sampler has no min-p path either
    return given


def refusal(sampling: Any, req: Any) -> str | None:
    """One line saying why DSPARK cannot serve this request exactly, or None."""
    given = used_refused(sampling, req)
    if not given:
        return None
    return f"DSPARK does not support {', '.join(given)} yet; send the request without them or serve without DSPARK"
