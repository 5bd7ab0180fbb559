"""A small random-weight Llama-shaped target in plain torch (RMSNorm, RoPE, grouped-query attention, SwiGLU) with a
KV cache per request: the target the decode step verifies against where SGLang is absent (the GPU machine) or too
heavy (unit tests). Its verify forward reads the step's rows with the tree mask and the prefix columns, as SGLang's
FlashInfer backend gets them (`layout.verify_forward_input`: each request's real rows); its commit keeps the K/V of
the rows on the accepted path, as the worker's commit keeps them; it hands the drafter the outputs of its capture
layers, as SGLang's capture hook does. Float64, so no batch shape can flip an argmax.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sgl_dspark.drafter.fresh import hf_config_for_target, random_drafter
from sgl_dspark.drafter.model import TargetWeights
from sgl_dspark.layout import AcceptRows, VerifyForwardInput


@dataclass(frozen=True)
class LlamaShape:
    vocab: int = 16
    hidden: int = 576
    layers: int = 4
    heads: int = 9  # 9:3 grouped-query attention, head_dim 64: SmolLM2-135M's attention shape
    kv_heads: int = 3
    head_dim: int = 64
    intermediate: int = 1024
    capture: tuple[int, ...] = (1, 2)  # layers whose outputs the drafter reads
    logit_scale: float = 3.0  # spread of the logits (the LM head's scale on unit-RMS hidden states)


@dataclass(frozen=True)
class Forward:
    logits: torch.Tensor  # [n, V] float64
    features: torch.Tensor  # [n, len(capture) * hidden] the capture layers' outputs
    keys: torch.Tensor  # [layers, n, kv_heads, head_dim] the rows' K (RoPE applied)
    values: torch.Tensor  # [layers, n, kv_heads, head_dim]


class LlamaTarget:
    def __init__(self, shape: LlamaShape = LlamaShape(), device: str = "cpu", seed: int = 0) -> None:
        self.shape, self.device = shape, torch.device(device)
        g = torch.Generator().manual_seed(seed)

        def w(*size: int, scale: float) -> torch.Tensor:
            return (torch.randn(*size, generator=g, dtype=torch.float64) * scale).to(self.device)

        s = shape
        h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.embed = w(s.vocab, h, scale=1.0)
        self.lm_head = w(s.vocab, h, scale=s.logit_scale * h ** -0.5)
        self.norms = [1 + 0.1 * w(h, scale=1.0) for _ in range(2 * s.layers + 1)]
        self.wq, self.wk, self.wv = ([w(n, h, scale=h ** -0.5) for _ in range(s.layers)] for n in (q, kv, kv))
        self.wo = [w(h, q, scale=q ** -0.5) for _ in range(s.layers)]
        self.w_gate, self.w_up = ([w(s.intermediate, h, scale=h ** -0.5) for _ in range(s.layers)] for _ in range(2))
        self.w_down = [w(h, s.intermediate, scale=s.intermediate ** -0.5) for _ in range(s.layers)]
        self.keys: dict[int, torch.Tensor] = {}  # request -> [layers, T, kv_heads, head_dim] committed K
        self.values: dict[int, torch.Tensor] = {}
        self.last: Forward | None = None  # the last verify forward (its rows' K/V wait for the commit)

    @property
    def vocab(self) -> int:
        return self.shape.vocab

    def weights(self, dtype: torch.dtype = torch.float32) -> TargetWeights:
        return TargetWeights(self.embed.to(dtype), self.lm_head.to(dtype))

    def drafter(self, device: str = "cpu", seed: int = 3):
        """A seeded random drafter shaped for this target (its width, heads, vocabulary and capture layers),
        borrowing this target's embedding and LM head on `device`."""
        s = self.shape
        config = {"num_hidden_layers": s.layers, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
                  "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
                  "vocab_size": s.vocab}
        model, _ = random_drafter(hf_config_for_target(config, num_layers=1, gamma=7, layer_ids=s.capture), seed)
        weights = self.weights()
        model.to(device).attach_target(TargetWeights(weights.embed.to(device), weights.lm_head.to(device)))
        return model

    # -- the forward ------------------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor) -> Forward:
        """tokens, positions [n]; past (K, V) [layers, T, kv_heads, head_dim] or None; mask [n, T + n] bool (the
        prefix columns first) -> logits, capture features and the rows' own K/V."""
        s = self.shape
        x = self.embed[tokens.to(self.device)]
        positions = positions.to(self.device)
        captured, keys, values = [], [], []
        for i in range(s.layers):
            k, v, x = self.layer(i, x, positions, None if past is None else (past[0][i], past[1][i]),
                                 mask.to(self.device))
            keys.append(k)
            values.append(v)
            if i in s.capture:
                captured.append(x)
        logits = rms(x, self.norms[-1]) @ self.lm_head.T
        return Forward(logits, torch.cat(captured, -1), torch.stack(keys), torch.stack(values))

    def layer(self, i: int, x: torch.Tensor, positions: torch.Tensor,
              past: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor):
        s = self.shape
        n = x.shape[0]
        a = rms(x, self.norms[2 * i])
        q = rope((a @ self.wq[i].T).view(n, s.heads, s.head_dim), positions)
        k = rope((a @ self.wk[i].T).view(n, s.kv_heads, s.head_dim), positions)
        v = (a @ self.wv[i].T).view(n, s.kv_heads, s.head_dim)
        all_k, all_v = (k, v) if past is None else (torch.cat([past[0], k]), torch.cat([past[1], v]))
        group = s.heads // s.kv_heads
        scores = torch.einsum("nhd,thd->hnt", q, all_k.repeat_interleave(group, 1)) * s.head_dim ** -0.5
        scores = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
        out = torch.einsum("hnt,thd->nhd", scores, all_v.repeat_interleave(group, 1)).reshape(n, -1)
        x = x + out @ self.wo[i].T
        m = rms(x, self.norms[2 * i + 1])
        x = x + (torch.nn.functional.silu(m @ self.w_gate[i].T) * (m @ self.w_up[i].T)) @ self.w_down[i].T
        return k, v, x

    # -- what the step harness calls -----------------------------------------------------------------------------

    def prefill(self, b: int, tokens: Sequence[int]) -> torch.Tensor:
        """Request b's context (its prompt without the anchor) into its cache -> the context's features."""
        n = len(tokens)
        out = self.forward(torch.tensor(tokens), torch.arange(n), None, torch.ones(n, n, dtype=torch.bool).tril())
        self.keys[b], self.values[b] = out.keys, out.values
        return out.features

    def verify(self, verify: VerifyForwardInput, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's verify input (each request's real rows, the mask with the prefix columns, as the GPU backend reads
        it) -> (logits [R, V], features [R, F]), request by request over each one's cache."""
        outs, at, row = [], 0, 0
        for b, (n, size) in enumerate(zip(seq_lens, verify.sizes)):
            span = size * (n + size)
            at, m = at + span, verify.mask[at:at + span].view(size, n + size)
            outs.append(self.forward(verify.tokens[row:row + size], verify.positions[row:row + size],
                                     (self.keys[b], self.values[b]), m))
            row += size
        self.last = Forward(torch.cat([o.logits for o in outs]), torch.cat([o.features for o in outs]),
                            torch.cat([o.keys for o in outs], 1), torch.cat([o.values for o in outs], 1))
        self.last_row = torch.full((verify.width * len(seq_lens),), -1, dtype=torch.long)  # flat row -> its real row
        self.last_row[verify.real] = torch.arange(verify.real.numel())
        return self.last.logits, self.last.features

    def commit(self, accepted: AcceptRows) -> None:
        """Keep each request's root and accepted rows of the last verify forward in its cache."""
        for b, index in enumerate(accepted.accept_index):
            kept = self.last_row[index[index >= 0].cpu()].to(self.device)
            self.append(b, self.last.keys[:, kept], self.last.values[:, kept])

    def append(self, b: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[b], self.values[b] = torch.cat([self.keys[b], keys], 1), torch.cat([self.values[b], values], 1)

    def plain(self, prompt: Sequence[int], tokens: int, choose: Callable[[torch.Tensor, int], int]) -> list[int]:
        """Plain decoding of `prompt` by this target, one row a step over its cache (kept apart, as request -1):
        choose(logits [1, V], position) picks each token."""
        self.prefill(-1, prompt[:-1])
        out = [prompt[-1]]
        for _ in range(tokens):
            n = self.keys[-1].shape[1]
            f = self.forward(torch.tensor(out[-1:]), torch.tensor([n]), (self.keys[-1], self.values[-1]),
                             torch.ones(1, n + 1, dtype=torch.bool))
            self.append(-1, f.keys, f.values)
            out.append(choose(f.logits, n))
        return out[1:]


def law_of_two(target: LlamaTarget, prompt: Sequence[int],
               probs: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """[V, V] float64: P(first two tokens after `prompt` = (y1, y2)) under plain sampling from this target, each token
    drawn from probs(logits [n, V]) -> [n, V]."""
    first: list[torch.Tensor] = []
    target.plain(prompt, 1, lambda logits, _: first.append(probs(logits)[0].double().cpu()) or 0)
    rows = []
    for y1 in range(target.vocab):
        rows.append([])
        target.plain((*prompt, y1), 1, lambda logits, _, row=rows[-1]: row.append(probs(logits)[0].double().cpu()) or 0)
    return first[0][:, None] * torch.stack([r[0] for r in rows])


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x [n, heads, head_dim] rotated by position (the rotate-half convention)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angles = positions.to(torch.float64)[:, None] * freqs[None]  # [n, half]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
