"""The parallel backbone against a dense oracle, and the context-K/V caching path (incremental == all at once)."""

import pytest
import torch

from sgl_dspark.drafter.config import TargetSpec
from sgl_dspark.drafter.context import ContextKV, pad_contexts
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.drafter.model import TargetWeights


def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, pos, theta=10000.0):
    """x [T, heads, d], HF rotate-half RoPE."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).double() / d)
    ang = torch.cat([pos.double()[:, None] * inv] * 2, -1)[:, None, :]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return (x * ang.cos() + rot * ang.sin()).float()


def oracle_block(drafter, features, anchor):
    """DeepSpec-style dense forward for one request: keys/values over [context ; block], no mask, explicit softmax."""
    cfg, t = drafter.config, features.shape[0]
    ctx = rms(features @ drafter.fc.weight.T, drafter.hidden_norm.weight)
    ids = torch.full((cfg.query_len,), cfg.mask_token_id)
    ids[0] = anchor
    x = drafter.target.embed[ids]
    pos = torch.arange(t + cfg.query_len)
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    for layer in drafter.layers:
        a = layer.self_attn
        xn = rms(x, layer.input_layernorm.weight)
        both = torch.cat([ctx, xn])
        q = rope(rms(a.q_proj(xn).view(-1, cfg.num_attention_heads, cfg.head_dim), a.q_norm.weight), pos[t:])
        k = rope(rms(a.k_proj(both).view(-1, cfg.num_key_value_heads, cfg.head_dim), a.k_norm.weight), pos)
        v = a.v_proj(both).view(-1, cfg.num_key_value_heads, cfg.head_dim)
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / cfg.head_dim ** 0.5, -1)
        out = torch.einsum("hqk,khd->qhd", att, v).reshape(cfg.query_len, -1)
        x = x + a.o_proj(out)
        x = x + layer.mlp(rms(x, layer.post_attention_layernorm.weight))
    x = rms(x, drafter.norm.weight)
    return x if cfg.sample_from_anchor else x[1:]


def features(t, drafter, seed=1):
    return torch.randn(t, drafter.config.num_features * drafter.config.hidden_size,
                       generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [{}, {"sample_from_anchor": False}, {"num_key_value_heads": 4},
                                       {"attention_bias": True}])
def test_block_pass_matches_dense_oracle(overrides):
    drafter, _ = random_drafter(tiny_hf_config(**overrides))
    f = features(7, drafter)
    ctx = pad_contexts([drafter.context_kv(f, torch.arange(7))])
    got = drafter.block_hidden(ctx, torch.tensor([5]), torch.tensor([7]))[0]
    assert got.shape == (4, 32)
    torch.testing.assert_close(got, oracle_block(drafter, f, 5), atol=1e-4, rtol=1e-4)


def test_context_rows_incremental_equal_all_at_once():
    drafter, _ = random_drafter(tiny_hf_config())
    f = features(9, drafter)
    whole = drafter.context_kv(f, torch.arange(9))
    parts = ContextKV.cat([drafter.context_kv(f[:4], torch.arange(4)), drafter.context_kv(f[4:], torch.arange(4, 9))])
    torch.testing.assert_close(parts.keys, whole.keys)
    torch.testing.assert_close(parts.values, whole.values)
    assert whole.keys.shape == (2, 9, 2, 8)


def test_cached_prefix_then_new_rows_gives_the_same_block():
    """A radix hit: rows of the first 6 tokens come from a slot pool, the last 3 are computed now."""
    drafter, _ = random_drafter(tiny_hf_config())
    f = features(9, drafter)
    pool = drafter.context_kv(f[:6], torch.arange(6))  # as if stored at slots 0..5
    slots = torch.tensor([0, 1, 2, 3, 4, 5])
    ctx = ContextKV.cat([pool.select(slots), drafter.context_kv(f[6:], torch.arange(6, 9))])
    got = drafter.block_hidden(pad_contexts([ctx]), torch.tensor([3]), torch.tensor([9]))
    want = drafter.block_hidden(pad_contexts([drafter.context_kv(f, torch.arange(9))]), torch.tensor([3]),
                                torch.tensor([9]))
    torch.testing.assert_close(got, want)


def test_padded_batch_equals_each_request_alone():
    drafter, _ = random_drafter(tiny_hf_config())
    lens, anchors = [3, 8, 0], torch.tensor([4, 9, 11])
    ctxs = [drafter.context_kv(features(n, drafter, seed=n), torch.arange(n)) for n in lens]
    batch = drafter.block_hidden(pad_contexts(ctxs), anchors, torch.tensor(lens))
    for i, n in enumerate(lens):
        alone = drafter.block_hidden(pad_contexts([ctxs[i]]), anchors[i:i + 1], torch.tensor([n]))
        torch.testing.assert_close(batch[i:i + 1], alone, atol=1e-5, rtol=1e-5)


def test_target_weights_are_not_saved():
    drafter, _ = random_drafter(tiny_hf_config(draft_vocab_size=20))
    names = set(drafter.state_dict())
    assert "d2t" in names and not any(n.startswith(("embed", "lm_head", "rotary")) for n in names)


def test_attach_target_checks_shapes_and_target_spec_reads_hf_config():
    drafter, spec = random_drafter(tiny_hf_config())
    with pytest.raises(ValueError, match=r"target lm_head has shape \(50, 16\), drafter expects \(50, 32\)"):
        drafter.attach_target(TargetWeights(torch.zeros(50, 32), torch.zeros(50, 16)))
    hf = {"text_config": {"hidden_size": 32, "vocab_size": 50, "num_hidden_layers": 6}}
    assert TargetSpec.from_hf_config(hf) == spec
