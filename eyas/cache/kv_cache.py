"""Paged KV storage: per layer, `num_blocks` blocks of `block_size` slots. Block 0 is a scratch block that padded
tokens may write to; it is never handed to a sequence."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.config import ModelConfig


@dataclass
class KVCache:
    k: torch.Tensor  # [layers, num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int, dtype, device):
        shape = (num_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, num_layers: int, block_size: int, dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem
