"""The verify batch goes onto SGLang's batch in one place (`verifying`), the forward sees each request's real rows
only, and the batch is a decode batch after, its KV slots the fixed-width window the commit reads."""

from types import SimpleNamespace

import pytest
import torch
from sglang.kernels.ops.speculative import cache_locs
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

from attention_backends.mask import spec_row_counts
from scheduler_patch.runtime.verify_mode import verifying
from sgl_dspark.layout import VerifyForwardInput

# two requests (pool rows 1 and 0), 3 and 1 cached tokens, a verify width of 2 (request 0 a chain of 2 rows,
# request 1 its anchor alone); req_to_token[r, c] = 10 * r + c
REQ_TO_TOKEN = torch.arange(3)[:, None] * 10 + torch.arange(8)[None, :]
VERIFY = VerifyForwardInput(torch.tensor([5, 6, 9]), torch.tensor([3, 4, 1]),
                            torch.tensor([True, False, True, True, True]), sizes=(2, 1), width=2,
                            real=torch.tensor([0, 1, 2]))


def decode_batch() -> SimpleNamespace:
    return SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=[object(), object()], input_ids=None,
                           out_cache_loc=None, spec_info=None, req_pool_indices=torch.tensor([1, 0]),
                           seq_lens=torch.tensor([3, 1]))


def slots_past_the_cache(req_pool_indices, req_to_token, start_offset, end_offset, batch_size, draft_token_num,
                         device):
    """SGLang's kernel, as a slow reference (its CPU path needs the CPU platform a server sets up)."""
    assert batch_size == len(req_pool_indices) and device == "cpu"
    return torch.cat([req_to_token[r, s:e] for r, s, e in zip(req_pool_indices, start_offset, end_offset)])


def test_inside_the_batch_is_the_verify_batch_with_the_slots_past_each_requests_cache(monkeypatch):
    monkeypatch.setattr(cache_locs, "assign_extend_cache_locs_func", slots_past_the_cache)
    batch = decode_batch()
    with verifying(batch, VERIFY, REQ_TO_TOKEN, "cpu"):
        assert batch.forward_mode == ForwardMode.TARGET_VERIFY
        assert batch.input_ids.tolist() == [5, 6, 9]
        assert batch.out_cache_loc.tolist() == [13, 14, 1]  # no slot for request 1's padding row
        spec = batch.spec_info
        assert spec.draft_token_num == 2 and spec.positions.tolist() == [3, 4, 1]
        assert spec_row_counts(spec, 2) == [2, 1]
        assert spec.custom_mask.tolist() == VERIFY.mask.tolist()
        assert spec.capture_hidden_mode == CaptureHiddenMode.FULL
    assert batch.forward_mode == ForwardMode.DECODE
    assert batch.out_cache_loc.tolist() == [13, 14, 1, 2]  # the window the commit moves the accepted rows in


def test_the_batch_is_a_decode_batch_again_even_when_the_step_fails(monkeypatch):
    monkeypatch.setattr(cache_locs, "assign_extend_cache_locs_func", slots_past_the_cache)
    batch = decode_batch()
    with pytest.raises(RuntimeError), verifying(batch, VERIFY, REQ_TO_TOKEN, "cpu"):
        raise RuntimeError("target forward failed")
    assert batch.forward_mode == ForwardMode.DECODE
