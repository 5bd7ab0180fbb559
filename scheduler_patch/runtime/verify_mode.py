"""The one place a decode step's verify input (sgl_dspark.layout.VerifyForwardInput) is put on SGLang's ScheduleBatch
and taken off again.

Inside `verifying` the batch is a TARGET_VERIFY batch (its input ids, KV slots and spec info those of the verify
rows) for the target's forward and the commit; after it, a decode batch again. SGLang sets input ids, KV slots and
spec info anew before the next forward, so only the forward mode is turned back. Must not run the target.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from attention_backends.mask import ROW_COUNTS
from sgl_dspark.layout import VerifyForwardInput


@contextmanager
def verifying(batch, verify: VerifyForwardInput, req_to_token: torch.Tensor, device) -> Iterator[None]:
    """SGLang's `batch` carries `verify` inside the block: each request's verify rows get the KV slots just past its
    cached tokens (req_to_token columns seq_len .. seq_len + n_b: the forward runs the real rows alone), hidden states
    are captured for the drafter, and the spec info says how many rows each request has (`ROW_COUNTS`). After the
    forward, `out_cache_loc` holds the fixed-width window (columns seq_len .. seq_len + width) the commit reads."""
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func

    window = assign_extend_cache_locs_func(
        req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token,
        start_offset=batch.seq_lens, end_offset=batch.seq_lens + verify.width, batch_size=len(batch.reqs),
        draft_token_num=verify.width, device=device)
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    batch.input_ids = verify.tokens.to(device)
    batch.out_cache_loc = window[verify.real.to(window.device)]
    spec = NgramVerifyInput(draft_token=batch.input_ids, custom_mask=verify.mask.to(device),
                            positions=verify.positions.to(device), draft_token_num=verify.width)
    spec.capture_hidden_mode = CaptureHiddenMode.FULL
    setattr(spec, ROW_COUNTS, list(verify.sizes))
    batch.spec_info = spec
    try:
        yield
    finally:
        batch.forward_mode = ForwardMode.DECODE
        batch.out_cache_loc = window
