"""The frozen target model for training: a transformers causal LM run over whole token sequences.

Owns one pass -> the drafter's features (outputs of `target_layer_ids`, as SGLang's capture hooks return them:
layer i's output is the residual stream entering layer i + 1) and the next-token logits. Must not train.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TargetPass:
    features: torch.Tensor  # [T, n_layers * H] (model dtype)
    logits: torch.Tensor  # [T, V] (model dtype): row t predicts token t + 1
    hidden: tuple[torch.Tensor, ...]  # [T, H] per entry: hidden[i] enters layer i (hidden[0] = embeddings)


class FrozenTarget:
    def __init__(self, model_path: str, dtype: torch.dtype, device: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.model.requires_grad_(False)
        self.device = device
        self.num_layers = self.model.config.num_hidden_layers

    @torch.inference_mode()
    def run(self, ids: list[int], layer_ids: tuple[int, ...]) -> TargetPass:
        x = torch.tensor([ids], device=self.device)
        out = self.model(input_ids=x, output_hidden_states=True)
        hidden = tuple(h[0] for h in out.hidden_states)
        features = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)
        return TargetPass(features.clone(), out.logits[0].clone(), hidden)

    @property
    def embed(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def layer(self, i: int):
        return self.model.model.layers[i]

    @property
    def final_norm(self):
        return self.model.model.norm
