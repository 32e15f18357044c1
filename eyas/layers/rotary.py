"""Rotary position embedding, with Llama 3's frequency scaling (`rope_type: llama3`)."""
import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [..., H, D] and k [..., KVH, D] at integer positions [...]."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    # tree tokens of a sequence near the context limit look a few positions past it
    MARGIN = 64

    @classmethod
    def for_config(cls, cfg, max_positions: int | None = None) -> "RotaryEmbedding":
        n = max(max_positions or 0, cfg.max_position_embeddings) + cls.MARGIN
        return cls(cfg.head_dim, n, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(-2)  # [..., 1, D]
        sin = self.sin[positions].unsqueeze(-2)
        qf, kf = q.float(), k.float()
        q = (qf * cos + rotate_half(qf) * sin).to(q.dtype)
        k = (kf * cos + rotate_half(kf) * sin).to(k.dtype)
        return q, k
