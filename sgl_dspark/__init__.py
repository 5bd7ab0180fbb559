"""sgl-dspark: DSpark speculative decoding as an SGLang plugin.

The pure core (drafter, tree, sampling, verify, verify budget, calibration, config), the draft worker and the tools
import no SGLang and nothing from `scheduler_patch/`, the one seam into SGLang (the plugin, its patches and the DSPARK
worker SGLang's scheduler runs); the attention backends are `attention_backends/`.

Glossary (used the same way in every module):
- anchor: the last token the target produced; it opens the next draft block and is verified as the root.
- block: anchor + draft tokens proposed in one drafting step (a chain, or a tree rooted at the anchor).
- gamma: the drafter's maximum block length (draft positions per parallel pass, `block_size`).
- draft length: how many draft tokens one request actually drafted this step (dynamic window, <= gamma).
- verify length: how many of them the verify budget sends to the target (a prefix of the chain / a
  prefix-closed node set of the tree).
- verify budget: the per-step choice of which drafted nodes each request verifies (`budget`); "scheduler" means
  SGLang's scheduler only.
- accepted length (tau): tokens a verify step commits, counting the bonus token (so tau >= 1).
- bonus token: the token the target samples itself after the last accepted draft token.
- confidence: c_k, the drafter's estimate of P(draft k accepted | all before it accepted).
- survival: a_k = prod_{i<=k} c_i, the probability that draft position k is reached and accepted.
- slot: a KV-cache slot, the index of one token's entry in SGLang's token-to-KV pool (`out_cache_loc`,
  `req_to_token`). A request's context is the list of its tokens' slots; the drafter stores its context rows at the
  same slot ids, so a radix-cache prefix hit reuses draft context too.
- verify rows: what the target's verify forward runs on, request after request: each request's scheduled block's
  nodes (anchor first) and nothing else (no padding), each row with its position (its parent's + 1) and a tree-mask
  row that sees the cached prefix, itself and its ancestors only (`layout.verify_forward_input`). Acceptance and the
  commit read the forward's outputs laid out `width` rows per request (`layout.VerifyRows`, `layout.padded`): there
  a smaller block is followed by padding nodes that repeat the anchor, hang off the root and are never accepted.
- width: the rows per request of that layout in one step: the largest scheduled block of the step, anchor included
  (`layout.pack_trees`); it changes every step and never exceeds the stride.
- stride: the rows SGLang reserves per request for a verify step, fixed at start-up: 1 + the most draft nodes one
  request can verify (`DSparkKnobs.verify_nodes`; SGLang's `speculative_num_draft_tokens`). No block may have more
  rows; the accept layout's emitted tokens are this wide (`layout.AcceptRows.tokens`).
"""

__version__ = "0.1.0"

_OFFLINE_API = ("DSparkEngine", "DSparkConfig", "DSparkOutput")  # sgl_dspark.engine: the offline API, loaded lazily


def __getattr__(name: str):
    if name in _OFFLINE_API:
        from sgl_dspark import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'sgl_dspark' has no attribute {name!r}")
