"""Triton kernels (split tree attention, paged KV writes, fused norm/RoPE/SwiGLU, decode GEMVs). See docs/kernels.md.

Nothing here imports Triton until a kernel is first asked for (PEP 562 module `__getattr__`), so that
`import eyas.kernels` works without Triton and `TRITON_INTERPRET=1` may still be set after it.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "paged_prefix_attention": "tree_attention",
    "tree_suffix_attention": "tree_attention",
    "merge_attention_states": "tree_attention",
    "split_tree_attention_triton": "tree_attention",
    "choose_num_splits": "tree_attention",
    "write_kv_triton": "kv_write",
    "commit_tree_kv_triton": "kv_write",
    "commit_tree_kv_reference": "kv_write",
    "add_rms_norm_triton": "fused_norm",
    "add_rms_norm_reference": "fused_norm",
    "rope_triton": "fused_rope",
    "rope_reference": "fused_rope",
    "rope_store_triton": "fused_rope",
    "rope_store_reference": "fused_rope",
    "swiglu_triton": "swiglu",
    "topk_indices_triton": "chunk_topk",
    "accept_tree_greedy_triton": "accept_greedy",
    "uniform_triton": "uniform",
    "carry_inputs_triton": "carry",
    "draft_pairs_triton": "draft_pairs",
    "draft_pairs_reference": "draft_pairs",
    "swiglu_reference": "swiglu",
    "decode_linear": "decode_linear",
    "decode_linear_reference": "decode_linear",
    "decode_qkv_rope": "decode_linear",
    "decode_qkv_rope_reference": "decode_linear",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
