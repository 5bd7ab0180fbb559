"""`sampling_seed` through DSPARK: one seed, one output (sgl_dspark.seeded: the target's token at each verify row
is SGLang's seeded Gumbel-max choice, fixed before the drafts are looked at), whatever else is in the batch and
whatever the drafter proposed; different seeds give different samples."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import generate

pytestmark = pytest.mark.integration

PROMPT = "Write a short story about a robot who learns to paint."
SEEDED = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 48, "ignore_eos": True}
OTHERS = ["def quicksort(xs):\n", "The capital of France is", "List five fruits:", "1, 1, 2, 3, 5, 8,"]


def test_one_seed_one_output_alone_and_in_a_batch(chain_server):
    alone = [generate(chain_server.base_url, PROMPT, sampling_seed=1234, **SEEDED)["output_ids"] for _ in range(2)]
    assert alone[0] == alone[1]
    with ThreadPoolExecutor(len(OTHERS) + 1) as pool:
        busy = [pool.submit(generate, chain_server.base_url, p, temperature=0.8, max_new_tokens=64) for p in OTHERS]
        batched = pool.submit(generate, chain_server.base_url, PROMPT, sampling_seed=1234, **SEEDED).result()
        [f.result() for f in busy]
    assert batched["output_ids"] == alone[0]
    assert batched["meta_info"]["spec_verify_ct"] > 0


def test_seeds_give_different_samples(chain_server):
    outs = {tuple(generate(chain_server.base_url, PROMPT, sampling_seed=s, **SEEDED)["output_ids"]) for s in range(4)}
    assert len(outs) >= 3
