"""The one plan a FlashInfer verify forward shares across layers, and the start-up refusals, as literal cases."""

import pytest

from attention_backends.layers import LayerSpec, PlanDims, RunnerFacts, VerifyRefusal, check_runner, plan_dims

LLAMA = LayerSpec(q_heads=8, kv_heads=2, head_dim_qk=128, head_dim_vo=128, scaling=0.125)
SERVER = RunnerFacts(reads_untranslated=False, dequant_workspace=False, verify_graphs=True)


def spec(**changes) -> LayerSpec:
    return LayerSpec(**{**LLAMA.__dict__, **changes})


def test_uniform_layers_plan_their_own_dims():
    assert plan_dims([LLAMA, LLAMA]) == PlanDims(8, 2, 128, 128, 0.125, 0.0)


def test_query_heads_are_planned_at_the_most_any_layer_runs():
    assert plan_dims([spec(q_heads=4), LLAMA, spec(q_heads=2)]).num_qo_heads == 8


def test_soft_cap_and_value_head_size_are_planned():
    dims = plan_dims([spec(logit_cap=50.0, head_dim_vo=64)] * 2)
    assert dims.logits_soft_cap == 50.0 and dims.head_dim_vo == 64 and dims.head_dim_qk == 128


@pytest.mark.parametrize("change, words", [
    (dict(kv_heads=4), "differ in kv_heads (2, 4)"),
    (dict(scaling=0.1), "differ in scaling (0.1, 0.125)"),
    (dict(logit_cap=30.0), "differ in logit_cap (0.0, 30.0)"),
    (dict(head_dim_vo=64), "differ in head_dim_vo (64, 128)"),
])  # fmt: skip
def test_layers_that_cannot_share_a_plan_are_refused(change, words):
    with pytest.raises(VerifyRefusal, match=words.replace("(", r"\(").replace(")", r"\)")):
        plan_dims([LLAMA, spec(**change)])


@pytest.mark.parametrize("change, words", [
    (dict(sliding_window=4096), "sliding-window layers"),
    (dict(self_attention=False), "cross-attention"),
    (dict(logit_cap=30.0, capping_method="clip"), "capping method 'clip'"),
    (dict(q_heads=6, kv_heads=4), "not a multiple"),
])  # fmt: skip
def test_layers_the_verify_pass_cannot_compute_are_refused(change, words):
    with pytest.raises(VerifyRefusal, match=words):
        plan_dims([spec(**change)])


def test_a_model_without_attention_layers_is_refused():
    with pytest.raises(VerifyRefusal, match="no RadixAttention layers"):
        plan_dims([])


def test_refusals_are_one_line():
    for layers in ([spec(sliding_window=8)], [LLAMA, spec(scaling=1.0)], []):
        with pytest.raises(VerifyRefusal) as error:
            plan_dims(layers)
        assert "\n" not in str(error.value)


def test_runner_facts():
    check_runner(SERVER, plan_dims([LLAMA]))
    check_runner(RunnerFacts(False, False, False), plan_dims([spec(logit_cap=30.0)]))  # eager only: soft cap is ours
    with pytest.raises(VerifyRefusal, match="--dcp-size"):
        check_runner(RunnerFacts(True, False, False), plan_dims([LLAMA]))
    with pytest.raises(VerifyRefusal, match="FP4 KV"):
        check_runner(RunnerFacts(False, True, False), plan_dims([LLAMA]))
    for layer in (spec(logit_cap=30.0), spec(head_dim_vo=64)):
        with pytest.raises(VerifyRefusal, match="--disable-cuda-graph"):
            check_runner(SERVER, plan_dims([layer]))


def test_model_dims_reads_sglangs_radix_attention_layers():
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention

    from attention_backends.flashinfer_backend import model_dims

    gemma_like = torch.nn.ModuleList([RadixAttention(8, 256, 0.0625, 4, layer_id=i, logit_cap=50.0) for i in range(2)])
    assert model_dims(gemma_like) == PlanDims(8, 4, 256, 256, 0.0625, 50.0)
    windowed = torch.nn.ModuleList([RadixAttention(8, 128, 0.1, 8, layer_id=0, sliding_window_size=4096)])
    with pytest.raises(VerifyRefusal, match="window 4096"):
        model_dims(windowed)
