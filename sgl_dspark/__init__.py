"""sgl-dspark: DSpark speculative decoding as an SGLang plugin.

The pure core (drafter, tree, sampling, verify, scheduler, calibration, config), the draft worker and the tools
import no SGLang and nothing from `scheduler_patch/`, the one seam into SGLang (the plugin, its patches and the DSPARK
worker SGLang's scheduler runs); the attention backends are `attention_backends/`.

Glossary (used the same way in every module):
- anchor: the last token the target produced; it opens the next draft block and is verified as the root.
- block: anchor + draft tokens proposed in one drafting step (a chain, or a tree rooted at the anchor).
- gamma: the drafter's maximum block length (draft positions per parallel pass, `block_size`).
- draft length: how many draft tokens one request actually drafted this step (dynamic window, <= gamma).
- verify length: how many of them the scheduler sends to the target (a prefix of the chain / a
  prefix-closed node set of the tree).
- accepted length (tau): tokens a verify step commits, counting the bonus token (so tau >= 1).
- bonus token: the token the target samples itself after the last accepted draft token.
- confidence: c_k, the drafter's estimate of P(draft k accepted | all before it accepted).
- survival: a_k = prod_{i<=k} c_i, the probability that draft position k is reached and accepted.
"""

__version__ = "0.1.0"
