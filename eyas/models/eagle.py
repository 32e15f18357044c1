"""EAGLE-1 draft model: h' = layers(fc(cat(embed(token_{t+1}), h_t))).

Reads the checkpoint layout of SafeAILab/EAGLE (`fc.weight` [H, 2H], optional `fc.bias`, `layers.{i}.*`, no input
norm on layer 0, no final norm). It shares the target's embedding and LM head, and keeps its own KV cache (same
block tables as the target, its own tensors).
"""
from __future__ import annotations

import torch
from torch import nn

from eyas.config import ModelConfig
from eyas.layers.rotary import RotaryEmbedding
from eyas.models.llama import DecoderLayer, takes_fused_path


class EagleDraft(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not 1 <= cfg.num_hidden_layers <= 3:
            raise ValueError(f"an EAGLE draft has 1-3 decoder layers, not {cfg.num_hidden_layers}")
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, input_norm=i > 0) for i in range(cfg.num_hidden_layers))
        self.rope = RotaryEmbedding.for_config(cfg)
        self.fused_ops = False  # as LlamaForCausalLM.fused_ops: the Triton kernels, with autograd off only

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta=None,
                cache=None) -> torch.Tensor:
        """token_embeds [B, Q, H] (embedding of token t+1), hidden [B, Q, H] (target feature at t), positions
        [B, Q] (= t) -> predicted feature at t+1. Without meta/cache: causal attention over the block (training)."""
        x = self.fc(torch.cat([token_embeds, hidden.to(token_embeds.dtype)], dim=-1))
        if takes_fused_path(self, x.device):
            res = None
            for layer in self.layers:
                x, res = layer.forward_fused(x, res, positions, self.rope, meta, cache)
            return res + x  # no final norm: the last residual add stays a plain add
        for layer in self.layers:
            x = layer(x, positions, self.rope, meta, cache)
        return x
