"""EAGLE-1 draft model: h' = layers(fc(cat(embed(token_{t+1}), h_t))).

Reads the checkpoint layout of SafeAILab/EAGLE (`fc.weight` [H, 2H], optional `fc.bias`, `layers.{i}.*`, no input
norm on layer 0, no final norm). It shares the target's embedding and LM head, and keeps its own KV cache (same
block tables as the target, its own tensors).

Feature layers (EAGLE-3 style, `config.feature_layers` = (i_1, ..., i_k)): the draft also reads the target's
rms-normalised residual stream after layers i_1..i_k. The target returns them with the final hidden state as one
[.., (k+1)H] feature (`LlamaForCausalLM.forward(feature_layers=...)`), and `read_features` maps it to H through
`fuse` ([H, (k+1)H], no bias) before it enters `forward`, which is unchanged. `init_fuse_identity` makes `fuse`
pick the final hidden state: the draft then computes exactly what the EAGLE-1 draft with the same fc/layers does.
Without feature layers `read_features` is the identity.
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
        # tree levels of 1-64 tokens on eyas.kernels.decode_linear (`eyas.models.one_row.forward_draft_rows`; set by
        # enable_fast_path for small models)
        self.few_rows = False
        fl = cfg.feature_layers
        self.feature_layers: tuple[int, ...] | None = tuple(int(i) for i in fl) if fl is not None else None
        if self.feature_layers is not None:
            if not self.feature_layers or min(self.feature_layers) < 0 or \
                    len(set(self.feature_layers)) != len(self.feature_layers):
                raise ValueError(f"feature layers must be distinct layer indices >= 0, got {list(fl)}")
            # created last, so that fc and the layers draw the same random init as an EAGLE-1 draft's
            self.fuse = nn.Linear((len(self.feature_layers) + 1) * H, H, bias=False)

    def read_features(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's features [.., (k+1)H] (`LlamaForCausalLM.forward(feature_layers=self.feature_layers)`) ->
        the H-wide feature `forward` reads: `fuse(feats)`. Without feature layers: `feats` itself (the final hidden
        state), untouched."""
        if self.feature_layers is None:
            return feats
        return self.fuse(feats.to(self.fuse.weight.dtype))

    @torch.no_grad()
    def init_fuse_identity(self) -> None:
        """fuse.weight = [0 ... 0 | I]: `read_features` returns the final hidden state exactly, so the draft behaves
        as the EAGLE-1 draft with the same fc and layers (training from an EAGLE-1 checkpoint starts there)."""
        if self.feature_layers is None:
            raise ValueError("this draft has no feature layers")
        H = self.config.hidden_size
        w = self.fuse.weight
        w.zero_()
        w[:, -H:] = torch.eye(H, dtype=w.dtype, device=w.device)

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta=None,
                cache=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """token_embeds [B, Q, H] (embedding of token t+1), hidden [B, Q, H] (target feature at t), positions
        [B, Q] (= t) -> predicted feature at t+1. Without meta/cache: causal attention over the block (training).
        `out` [B, Q, H] (a view may do): written with the result and returned (the fast path's last residual add
        writes it directly, no copy after)."""
        return self.forward_pairs(torch.cat([token_embeds, hidden.to(token_embeds.dtype)], dim=-1), positions, meta,
                                  cache, out)

    def forward_pairs(self, pairs: torch.Tensor, positions: torch.Tensor, meta=None, cache=None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` from the concatenated pairs [B, Q, 2H] = cat(embed(token t+1), feature t), as
        `eyas.kernels.draft_pairs` builds them in one launch during decoding."""
        if self.few_rows and takes_fused_path(self, pairs.device):
            from eyas.models.one_row import forward_draft_rows, takes_draft_rows
            if takes_draft_rows(self, pairs, meta):  # a tree level: eyas.models.one_row
                return forward_draft_rows(self, pairs, positions, meta, cache, out)
        x = self.fc(pairs)
        if takes_fused_path(self, x.device):
            res = None
            for layer in self.layers[:-1]:
                x, res = layer.forward_fused(x, res, positions, self.rope, meta, cache)
            # no final norm: the last layer returns its output + residual itself (its down projection adds into the
            # residual), written to `out`
            if out is None:
                out = torch.empty_like(x)
            return self.layers[-1].forward_fused(x, res, positions, self.rope, meta, cache, out=out)
        for layer in self.layers:
            x = layer(x, positions, self.rope, meta, cache)
        return x if out is None else out.copy_(x)
