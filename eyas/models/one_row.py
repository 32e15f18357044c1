"""The one-row decode step: batch-1 plain decoding on `eyas.kernels.decode_linear` (issue #5, point 1).

A batch-1 plain decode step is a chain of weight-streaming GEMVs with small kernels between them. On this path each
decoder layer is five launches (four kernels and the prefix attention's split reduction) instead of ~12:

    q     = decode_qkv_rope(r, W_qkv, input_norm, ...)      RMSNorm, RoPE, K/V into the paged cache
    o     = paged prefix attention                          (and its split reduction)
    r     = decode_linear(o, W_o, residual=r, out=r)        the residual add folded in
    act   = decode_linear(r, W_gate_up, norm_weight=post_norm, swiglu=True)
    r     = decode_linear(act, W_down, residual=r, out=r)

`r` is the residual stream itself (the fused path's hidden + residual, summed at each add with the same rounding),
and the final norm gives the hidden state the draft and the head read. With PDL on sm_90 the GEMVs overlap their
starts with the kernel before. `LlamaForCausalLM.compute_logits` takes `decode_linear` for one row too. On the
H200 this took the 8B shape's plain step from 4.76-5.04 to 4.31-4.48 ms (same-call pairs) and SmolLM2's from 1.19
to 0.75 ms (docs/benchmarks.md, "Session 14").

One row only: `decode_linear` takes up to 8, but every program re-reads all of x, so at 4 rows the 8B verify pass
of `chain:3` ran at half the speed of cuBLAS and the fused kernels (session 14); steps of more tokens keep the fused
path. Taken only where it computes what the fused path computes: one token (B * Q == 1), a plain decoding step
(`meta.prefix_includes_new`, Triton attention), and a model whose projections are fused, bias-free nn.Linear
layers without hooks (no tensor parallelism, no quantized layers): `one_row_ready`. Feature layers (EAGLE-3 drafts)
are tapped from `r` as the fused path taps them. `enable_fast_path` switches it on (`model.one_row = True`). The
reference is the fused path itself (which the tests hold to the eager modules): tests/test_decode_linear.py holds
the two equal.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from eyas.layers.attention import AttentionMetadata, prefix_only_attention
from eyas.layers.norm import RMSNorm


def _plain(linear) -> bool:
    return (type(linear) is nn.Linear and linear.bias is None and linear.weight.is_contiguous()
            and not linear._forward_hooks and not linear._forward_pre_hooks)


def one_row_ready(model: nn.Module) -> bool:
    """Whether every layer of `model` (a LlamaForCausalLM), and its head, have what the one-row path needs."""
    if not _plain(model.lm_head):
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (hasattr(attn, "qkv_proj") and hasattr(mlp, "gate_up_proj")):
            return False
        if not all(_plain(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return False
        if not (isinstance(layer.input_layernorm, RMSNorm) and isinstance(layer.post_attention_layernorm, RMSNorm)):
            return False
        if layer._forward_hooks or attn._forward_hooks or mlp._forward_hooks:
            return False
    return True


def takes_one_row(model: nn.Module, x: torch.Tensor, meta: AttentionMetadata | None) -> bool:
    """`x` the embedded tokens [B, Q, H]."""
    return (getattr(model, "one_row", False) and meta is not None and meta.use_triton and meta.prefix_includes_new
            and x.shape[0] * x.shape[1] == 1 and x.dtype == model.model.norm.weight.dtype)


@functools.cache
def _pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA on sm_90 or newer (Hopper)."""
    return device.type == "cuda" and _pdl(device.index if device.index is not None else torch.cuda.current_device())


def forward_one_row(model: nn.Module, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, cache,
                    feature_layers: tuple[int, ...] | None = None):
    """x: the embedded token [1, 1, H] (a fresh tensor: it becomes the residual stream and is written in place).
    Returns what `LlamaForCausalLM.forward` returns: the final hidden state [1, 1, H], with the features when
    `feature_layers` is given."""
    from eyas.kernels import add_rms_norm_triton
    from eyas.kernels.decode_linear import decode_linear, decode_qkv_rope
    from eyas.models.llama import _rows as _row_store, with_features
    H = x.shape[-1]
    pdl = use_pdl(x.device)
    r = x.reshape(1, H)
    if not r.is_contiguous():
        r = r.contiguous()
    want = set(feature_layers) if feature_layers is not None else ()
    taps = {}
    rope = model.rope
    eps = model.config.rms_norm_eps
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        k_cache, v_cache = cache.k[attn.layer_idx], cache.v[attn.layer_idx]
        q = decode_qkv_rope(r, attn.qkv_proj.weight, n1.weight, n1.eps, positions, meta.slot_mapping, rope.cos,
                            rope.sin, _row_store(k_cache), _row_store(v_cache), attn.n_heads, pdl=pdl)
        o = prefix_only_attention(q.view(1, 1, attn.n_heads, attn.head_dim), k_cache, v_cache, meta, attn.scale,
                                  out_dtype=x.dtype)
        decode_linear(o.reshape(1, -1), attn.o_proj.weight, residual=r, out=r, pdl=pdl)
        act = decode_linear(r, mlp.gate_up_proj.weight, norm_weight=n2.weight, eps=n2.eps, swiglu=True, pdl=pdl)
        decode_linear(act, mlp.down_proj.weight, residual=r, out=r, pdl=pdl)
        if i in want:  # rms(r_i), as the fused path taps it (a unit-weight norm)
            taps[i] = add_rms_norm_triton(r, None, model._unit_weight(r), eps)[0].view(1, 1, H)
    norm = model.model.norm
    hidden = add_rms_norm_triton(r, None, norm.weight, norm.eps)[0].view(1, 1, H)
    return with_features(hidden, taps, feature_layers, len(model.model.layers))


def logits_one_row(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The head over one hidden row [..., H] -> [1, V] in the model dtype."""
    from eyas.kernels.decode_linear import decode_linear
    H = hidden.shape[-1]
    return decode_linear(hidden.reshape(-1, H), model.lm_head.weight, pdl=use_pdl(hidden.device))
