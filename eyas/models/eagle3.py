"""EAGLE-3 draft checkpoints (SafeAILab/EAGLE's layout, and vllm-project/speculators'), as vLLM and SGLang serve them.

The checkpoint's draft differs from the EAGLE-1 draft (`eyas.models.eagle`) in four places:

* Its features are three of the target's layers: the residual stream entering layers (2, L//2, L-3) (that is,
  after layers (1, L//2-1, L-4)), raw, concatenated low to high, without the final hidden state
  (`eyas.models.llama.RawTaps`). `fc` [H, 3H] maps them to H once, as the draft first reads them
  (`read_features`, as eyas's own feature-layer drafts do with `fuse`).
* Its first layer ("midlayer") attends over [input_layernorm(embed(token t+1)) ; hidden_norm(h_t)], 2H wide (q, k
  and v take 2H inputs); its residual is h_t itself (or hidden_norm(h_t) with `norm_before_residual`). Then the
  usual post-attention norm, SwiGLU MLP and residual add. Further layers, where a checkpoint has them, are plain
  Llama layers. What it returns (before any norm) is the next depth's h.
* It has its own final norm and LM head, over a draft vocabulary of Vd tokens: draft token j is target token
  j + d2t[j]. The head is attached as a draft vocabulary (`eyas.spec.draft_vocab`: `vocab_ids`, `vocab_head`) with
  `head_norm` before it, so every path that scores or restricts the draft's candidates reads it unchanged.
* Its RoPE follows its own config (theta 10000 where the config names none), not the target's.

The token embedding is the target's (the checkpoints do not carry one, or carry a copy). The forward has no fused
kernels of its own (`fused_ops` is ignored): the draft's levels run the modules' reference path, graphed on a GPU
as any step. Its reference, for the tests, is HF transformers' Llama modules wired as the checkpoints' code wires
them (tests/test_eagle3.py).
"""
from __future__ import annotations

import torch
from torch import nn

from eyas.config import ModelConfig
from eyas.layers.norm import RMSNorm
from eyas.layers.rotary import RotaryEmbedding
from eyas.models.llama import MLP, Attention, DecoderLayer, RawTaps


def eagle3_feature_layers(num_target_layers: int, aux_ids=None, output_ids: bool = False) -> RawTaps:
    """The target layers (0-based, "after layer i") whose raw outputs an EAGLE-3 draft reads: `aux_ids` as vLLM
    names them (the input of layer i, so after layer i - 1; default (2, L//2, L-3)), or with `output_ids` as
    SGLang's `eagle_config` does (the output of layer i)."""
    L = num_target_layers
    ids = [2, L // 2, L - 3] if aux_ids is None else [int(i) for i in aux_ids]
    after = ids if output_ids else [i - 1 for i in ids]
    if any(not 0 <= i < L for i in after) or len(set(after)) != len(after):
        raise ValueError(f"EAGLE-3 feature layers {ids} do not fit a target of {L} layers (distinct, each after "
                         "one of its layers)")
    return RawTaps(after)


class Eagle3Layer(nn.Module):
    """The draft's first layer: attention over [input_layernorm(embeds) ; hidden_norm(hidden)] (2H wide)."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool = False):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)  # on the hidden state
        self.self_attn = Attention(cfg, 0)
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * H, attn.n_heads * D, bias=False)
        attn.k_proj = nn.Linear(2 * H, attn.n_kv * D, bias=False)
        attn.v_proj = nn.Linear(2 * H, attn.n_kv * D, bias=False)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = norm_before_residual

    def attention_input(self, embeds, hidden):
        """(what the attention reads: [input_layernorm(embeds) ; hidden_norm(hidden)], the residual it adds to:
        hidden, or its norm with `norm_before_residual`)."""
        h = self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(embeds), h], dim=-1), h if self.norm_before_residual else hidden

    def forward(self, embeds, hidden, positions, rope, meta, cache):
        x, residual = self.attention_input(embeds, hidden)
        x = residual + self.self_attn(x, positions, rope, meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    """An EAGLE-3 checkpoint's draft, behind the interface of `EagleDraft` (`read_features`, `forward`,
    `forward_pairs`, `feature_layers`, `config`, `layers`), so that the engine drives it as any draft."""

    def __init__(self, cfg: ModelConfig, feature_layers: RawTaps, draft_vocab_size: int,
                 norm_before_residual: bool = False, fc_bias: bool = False):
        super().__init__()
        if cfg.num_hidden_layers < 1:
            raise ValueError("an EAGLE-3 draft has at least one layer")
        self.config = cfg
        H = cfg.hidden_size
        self.feature_layers = feature_layers
        self.fuse = nn.Linear(len(feature_layers) * H, H, bias=fc_bias)  # the checkpoint's `fc`
        self.layers = nn.ModuleList([Eagle3Layer(cfg, norm_before_residual)] +
                                    [DecoderLayer(cfg, i) for i in range(1, cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.rope = RotaryEmbedding.for_config(cfg)
        self.fused_ops = False  # set by enable_fast_path; this draft has no fused forward and ignores it

    def read_features(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's raw features [.., 3H] -> fc(feats) [.., H]."""
        return self.fuse(feats.to(self.fuse.weight.dtype))

    def attach_head(self) -> None:
        """The draft's head as a draft vocabulary (`eyas.spec.draft_vocab.draft_logits`): logits over Vd tokens of
        `head_norm(h)`, token j proposing target id j + d2t[j] (`vocab_ids`, a buffer: it moves with the draft).
        Call after loading d2t."""
        ids = torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t
        self.register_buffer("vocab_ids", ids, persistent=False)

    @property
    def head_norm(self) -> RMSNorm:
        return self.norm

    @property
    def vocab_head(self) -> torch.Tensor:
        return self.lm_head.weight

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta=None,
                cache=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """As `EagleDraft.forward`: embed(token t+1) [B, Q, H] and h_t [B, Q, H] at positions t -> h_{t+1}."""
        x = self.layers[0](token_embeds, hidden.to(token_embeds.dtype), positions, self.rope, meta, cache)
        for layer in self.layers[1:]:
            x = layer(x, positions, self.rope, meta, cache)
        return x if out is None else out.copy_(x)

    def forward_pairs(self, pairs: torch.Tensor, positions: torch.Tensor, meta=None, cache=None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` from cat(embed(token t+1), h_t) [B, Q, 2H] (`eyas.kernels.draft_pairs`)."""
        H = self.config.hidden_size
        return self.forward(pairs[..., :H], pairs[..., H:], positions, meta, cache, out)
