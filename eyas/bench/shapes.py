"""Random-weight models of real shapes, built on the device with no download (benchmarks only).

Under tensor parallelism (`rank`, `world_size`) the model is built on the meta device, sharded there by
`eyas.dist.apply_tensor_parallel`, and only this rank's slices are materialised on its device: a 70B shape at TP = 2
never exists whole anywhere. `llama-tiny-shape` is for tests and smoke runs."""
from __future__ import annotations

import dataclasses
import json

import torch

from eyas.config import ModelConfig
from eyas.dist.tp import apply_tensor_parallel
from eyas.loader.resolve import DRAFTS_DIR
from eyas.layers.rotary import RotaryEmbedding
from eyas.models.eagle import EagleDraft
from eyas.models.llama import LlamaForCausalLM

SHAPES = {
    "llama-3.1-8b-shape": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, rope_theta=500000.0, max_position_embeddings=8192,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}),
    "llama-3.3-70b-shape": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                       head_dim=128, rope_theta=500000.0, max_position_embeddings=8192),
    "llama-tiny-shape": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                                    max_position_embeddings=2048),
    "smollm2-shape": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                                 max_position_embeddings=8192, tie_word_embeddings=True,
                                 # its random draft quantized as the shipped SmolLM2 draft asks (fp8-head on a GPU)
                                 draft_quant=json.loads((DRAFTS_DIR / "smollm2" / "config.json").read_text())
                                 .get("eyas_draft_quant")),
}


def _random_init(module: torch.nn.Module, device, dtype, seed: int):
    module = module.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    return module


def random_target(name: str, device, dtype=torch.bfloat16, seed: int = 0, rank: int = 0, world_size: int = 1,
                  group=None) -> LlamaForCausalLM:
    """The shape `name` with random weights on `device`; with `world_size` > 1, only rank `rank`'s shard (its
    weights drawn from seed + rank: random either way)."""
    cfg = SHAPES[name]
    with torch.device("meta"):
        model = apply_tensor_parallel(LlamaForCausalLM(cfg), rank, world_size, group)  # world size 1: as is
    model = _random_init(model, device, dtype, seed + rank)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope = RotaryEmbedding.for_config(cfg).to(device)
    return model.eval().requires_grad_(False)


def random_draft(target: LlamaForCausalLM, layers: int = 1, seed: int = 1, config: ModelConfig | None = None,
                 rank: int = 0, world_size: int = 1, group=None) -> EagleDraft:
    """A random EAGLE draft of `config`'s width (default: the target's; pass the unsharded shape's config when the
    target is a tensor-parallel shard). `world_size` > 1 shards the draft too (else every rank holds it whole)."""
    cfg = dataclasses.replace(config or target.config, num_hidden_layers=layers)
    p = next(target.parameters())
    with torch.device("meta"):
        draft = apply_tensor_parallel(EagleDraft(cfg), rank, world_size, group)
    draft = _random_init(draft, p.device, p.dtype, seed)
    draft.rope = RotaryEmbedding.for_config(cfg).to(p.device)
    return draft.eval().requires_grad_(False)


def linear_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the weights a decode step must read (every linear layer, the LM head once); of this rank's shard
    under tensor parallelism (its vocabulary-parallel head included)."""
    from eyas.dist.tp import VocabParallelHead
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, VocabParallelHead)) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel() * m.weight.element_size()
    return total
