"""The one-row decode step: batch-1 plain decoding on `eyas.kernels.decode_linear` (issue #5, point 1), and
its few-rows sibling for steps of 2 to 64 tokens of small models.

A batch-1 plain decode step is a chain of weight-streaming GEMVs with small kernels between them. On this path each
decoder layer is five launches (four kernels and the prefix attention's split reduction) instead of ~12:

    q     = decode_qkv_rope(r, W_qkv, input_norm, ...)      RMSNorm, RoPE, K/V into the paged cache
    o     = paged prefix attention                          (and its split reduction)
    r     = decode_linear(o, W_o, residual=r, out=r)        the residual add folded in
    act   = decode_linear(r, W_gate_up, norm_weight=post_norm, swiglu=True)
    r     = decode_linear(act, W_down, residual=r, out=r)

`r` is the residual stream itself (the fused path's hidden + residual, summed at each add with the same rounding),
and the final norm gives the hidden state the draft and the head read. With PDL on sm_90 the GEMVs overlap their
starts with the kernel before, and the attention kernels let the o projection's programs in while they run
(`eyas.kernels.tree_attention.PDL`: SmolLM2's plain step 0.478 against 0.550 ms, the 8B shape's 4.06-4.07 against
4.14-4.15, session 20). `LlamaForCausalLM.compute_logits` takes `decode_linear` for one row too. On the
H200 this took the 8B shape's plain step from 4.76-5.04 to 4.31-4.48 ms (same-call pairs) and SmolLM2's from 1.19
to 0.75 ms (docs/benchmarks.md, "Session 14").

Steps of 2 to 64 tokens (`takes_few_rows`: batched plain decoding, and verify passes, whose K/V go to the step's
stash and whose attention is the split tree attention) take the same five launches a layer on `decode_linear`'s
tile kernel (two rows: its register kernel), for models where that pays: hidden size <= 1024 (`few_rows_pay`).
Session 15 measured (docs/bench/few_rows_s15.json) SmolLM2's `chain:3` at 0.509-0.528 ms/token against
0.565-0.603 without, and its plain decoding at batch 2 at 0.77-0.87 against 1.12-1.20; at the 8B shapes cuBLAS
streams the weights faster than the tiles (4.68 ms against 4.13 for a synthetic 4-row forward), and at 49 rows
(SmolLM2's default tree) the tiles lost too (0.82-0.93 against 0.75) until session 37's whole-K tile; since session 38
the path takes up to 64 tokens (FEW_ROWS_MAX). `enable_fast_path(few_rows=True)` sets
`model.few_rows`; `model.few_rows_max` (FEW_ROWS_MAX) bounds the rows. An EAGLE draft's tree levels of 1 to 64
tokens take the same kernels (`forward_draft_rows`; written after session 15's measurements, held to the fused
path by the tests).

Taken only where it computes what the fused path computes: a plain decoding step (`meta.prefix_includes_new`) or
tree tokens (`meta.stash`), Triton attention, and a model whose projections are fused, bias-free nn.Linear
layers without hooks (no tensor parallelism, no quantized layers): `one_row_ready`. Feature layers (EAGLE-3 drafts)
are tapped from `r` as the fused path taps them. `enable_fast_path` switches it on (`model.one_row = True`). The
reference is the fused path itself (which the tests hold to the eager modules): tests/test_decode_linear.py holds
the two equal.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from eyas.layers.attention import AttentionMetadata, prefix_only_attention, split_tree_attention
from eyas.layers.norm import RMSNorm
from eyas.models.llama import plain_linear


def _plain(linear, fp8: bool = False) -> bool:
    """A linear whose weight the row kernels read as it is: a plain nn.Linear (`plain_linear`: no bias, no hooks)
    with a contiguous weight, or with `fp8` also an FP8 one (`Fp8Linear`, an FP8 draft's) without bias or hooks
    and with contiguous codes."""
    if fp8 and _is_fp8(linear):
        return (linear.bias is None and linear.qweight.is_contiguous() and not linear._forward_hooks
                and not linear._forward_pre_hooks)
    return plain_linear(linear) and linear.weight.is_contiguous()


def _is_fp8(linear) -> bool:
    from eyas.layers.linear_fp8 import Fp8Linear
    return type(linear) is Fp8Linear


def _row_weight(linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the row kernels read of a linear that `layer_ready` accepted: (weight, None), or for an FP8 one (its
    codes, their row scales)."""
    return (linear.weight, None) if type(linear) is nn.Linear else (linear.qweight, linear.scale)


def layer_ready(layer: nn.Module, input_norm: bool, fp8: bool = False) -> bool:
    """A decoder layer with fused, plain projections (with `fp8`: or FP8 ones, an FP8 draft's), RMSNorms (no input
    norm where `input_norm` is False: an EAGLE draft's first layer), and no hooks."""
    attn, mlp = layer.self_attn, layer.mlp
    if not (hasattr(attn, "qkv_proj") and hasattr(mlp, "gate_up_proj")):
        return False
    if hasattr(attn, "q_norm"):  # Qwen3's per-head norms come between the projection and RoPE: the fused path
        return False
    if not all(_plain(m, fp8) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
        return False
    n1 = layer.input_layernorm
    if not (isinstance(n1, RMSNorm) if input_norm else isinstance(n1, nn.Identity)):
        return False
    if not isinstance(layer.post_attention_layernorm, RMSNorm):
        return False
    return not (layer._forward_hooks or attn._forward_hooks or mlp._forward_hooks)


def one_row_ready(model: nn.Module) -> bool:
    """Whether every layer of `model` (a LlamaForCausalLM), and its head, have what the one-row path needs."""
    return _plain(model.lm_head) and all(layer_ready(layer, True) for layer in model.model.layers)


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


# Where the tile kernels pay (H200, session 15, tools/diag/tile_chain_bench.py: synthetic forwards of linears and the
# small kernels): SmolLM2's shapes (hidden 576) at 4 rows, 0.63-0.65 ms against 0.72 for cuBLAS plus the small
# kernels; not at 49 rows (0.82 at the best configs against 0.74), and never at the 8B shapes (hidden 4096: 4.68 ms
# at the best configs against 4.13 at 4 rows; cuBLAS streams these weights faster than the Triton tiles). A small
# model's step is bound by its launches, a large one's by its weight bytes. Between 576 and 4096 it is unmeasured.
# FEW_ROWS_MAX was 16 until session 38. With the whole-K tile up to 64 rows (decode_linear.WHOLE_K_ROWS), the default
# tree's 49-row verify pass became faster on the tiles than on cuBLAS: on the real SmolLM2 (MT-Bench, batch 1) its
# step took 1.107-1.111 ms against 1.159-1.160, and on the smollm2-shape replay `chain:3` at batch 16 (64 rows)
# 1.134-1.143 against 1.169-1.191, with no batch size slower (docs/benchmarks.md, "Session 38"). Session 44 swept the
# 8B shapes at 4 rows again with today's tiles (PDL, early trigger): still slower than cuBLAS per kind at their best
# configs (qkv 23.4 us against 15.4, o 13.05 against 13.17, gate/up 66.8 against 60.5, down 39.0 against 32.8); o
# alone pays in the engine at 8-16 rows (`eyas.models.llama.O_TILE_ROWS`).
FEW_ROWS_MAX_HIDDEN = 1024
FEW_ROWS_MAX = 64


def few_rows_pay(model: nn.Module) -> bool:
    """Whether the measured boundary says the tile kernels beat cuBLAS for this model (hidden <= 1024)."""
    return model.config.hidden_size <= FEW_ROWS_MAX_HIDDEN


def takes_few_rows(model: nn.Module, x: torch.Tensor, meta: AttentionMetadata | None) -> bool:
    """`x` the embedded tokens [B, Q, H]: 2 to `model.few_rows_max` (FEW_ROWS_MAX) tokens of a plain decoding step
    or of tree tokens (a verify pass, whose K/V go to the stash), with `model.few_rows` set."""
    return (getattr(model, "few_rows", False) and meta is not None and meta.use_triton
            and (meta.prefix_includes_new or meta.stash is not None)
            and 2 <= x.shape[0] * x.shape[1] <= getattr(model, "few_rows_max", FEW_ROWS_MAX)
            and x.dtype == model.model.norm.weight.dtype)


def _layer_rows(layer: nn.Module, r: torch.Tensor, B: int, Q: int, pos: torch.Tensor, meta: AttentionMetadata, cache,
                rope, pdl: bool, out: torch.Tensor | None = None) -> None:
    """One decoder layer in five launches over the residual stream r [B * Q, H], updated in place (or, with `out`,
    its final value written there instead: the down projection adds r into `out`). The input norm is skipped where
    the layer has none (an EAGLE draft's first). Plain decoding (`meta.prefix_includes_new`): K/V to the cache at
    the slots, then the prefix pass; tree tokens: K/V to the stash, the suffix over its rows merged with the
    prefix."""
    from eyas.kernels.decode_linear import decode_linear, decode_qkv_rope
    from eyas.models.llama import _rows as _row_store
    attn, mlp = layer.self_attn, layer.mlp
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    norm, eps = (n1.weight, n1.eps) if isinstance(n1, RMSNorm) else (None, 0.0)
    k_cache, v_cache = cache.k[attn.layer_idx], cache.v[attn.layer_idx]
    w_qkv, s_qkv = _row_weight(attn.qkv_proj)
    if meta.prefix_includes_new:
        q = decode_qkv_rope(r, w_qkv, norm, eps, pos, meta.slot_mapping, rope.cos, rope.sin,
                            _row_store(k_cache), _row_store(v_cache), attn.n_heads, pdl=pdl, scale=s_qkv)
        o = prefix_only_attention(q.view(B, Q, attn.n_heads, attn.head_dim), k_cache, v_cache, meta, attn.scale,
                                  out_dtype=r.dtype, pdl=pdl)
    else:
        sk, sv = meta.stash.k[attn.layer_idx], meta.stash.v[attn.layer_idx]
        end = meta.stash_at + Q
        q = decode_qkv_rope(r, w_qkv, norm, eps, pos, None, rope.cos, rope.sin, _row_store(sk),
                            _row_store(sv), attn.n_heads, seq_rows=sk.shape[1], row_offset=meta.stash_at, seq_q=Q,
                            pdl=pdl, scale=s_qkv)
        o = split_tree_attention(q.view(B, Q, attn.n_heads, attn.head_dim), sk[:, meta.suffix_from: end],
                                 sv[:, meta.suffix_from: end], k_cache, v_cache, meta, attn.scale, out_dtype=r.dtype,
                                 pdl=pdl)
    w, sc = _row_weight(attn.o_proj)
    decode_linear(o.reshape(B * Q, -1), w, residual=r, out=r, pdl=pdl, scale=sc)
    w, sc = _row_weight(mlp.gate_up_proj)
    act = decode_linear(r, w, norm_weight=n2.weight, eps=n2.eps, swiglu=True, pdl=pdl, scale=sc)
    w, sc = _row_weight(mlp.down_proj)
    decode_linear(act, w, residual=r, out=r if out is None else out, pdl=pdl, scale=sc)


def forward_rows(model: nn.Module, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, cache,
                 feature_layers: tuple[int, ...] | None = None):
    """x: the embedded tokens [B, Q, H] (a fresh tensor: it becomes the residual stream and is written in place);
    one token (`takes_one_row`), or 2 to `few_rows_max` (`takes_few_rows`; for tree tokens the K/V go to the stash
    and the attention is the split tree attention). Returns what `LlamaForCausalLM.forward`
    returns: the final hidden state [B, Q, H], with the features when `feature_layers` is given."""
    from eyas.kernels import add_rms_norm_triton
    from eyas.models.llama import is_raw, with_features
    B, Q, H = x.shape
    M = B * Q
    pdl = use_pdl(x.device)
    r = x.reshape(M, H)
    if not r.is_contiguous():
        r = r.contiguous()
    pos = positions.expand(B, Q).reshape(M)
    want = set(feature_layers) if feature_layers is not None else ()
    taps = {}
    eps = model.config.rms_norm_eps
    for i, layer in enumerate(model.model.layers):
        _layer_rows(layer, r, B, Q, pos, meta, cache, model.rope, pdl)
        if i in want and is_raw(feature_layers):  # r_i itself (EAGLE-3's features); r is updated in place
            taps[i] = r.clone().view(B, Q, H)
        elif i in want:  # rms(r_i), as the fused path taps it (a unit-weight norm)
            taps[i] = add_rms_norm_triton(r, None, model._unit_weight(r), eps)[0].view(B, Q, H)
    norm = model.model.norm
    hidden = add_rms_norm_triton(r, None, norm.weight, norm.eps)[0].view(B, Q, H)
    return with_features(hidden, taps, feature_layers, len(model.model.layers))


def draft_rows_ready(draft: nn.Module) -> bool:
    """Whether an EagleDraft has what `forward_draft_rows` needs: fc and every layer's fused projections plain
    nn.Linear layers, or FP8 ones (`--draft-quant fp8`), without bias or hooks (not INT4, not sharded), RMSNorms, no
    input norm only on layer 0."""
    return _plain(draft.fc, fp8=True) and all(
        layer_ready(layer, isinstance(layer.input_layernorm, RMSNorm) or i > 0, fp8=True)
        for i, layer in enumerate(draft.layers))


# A large draft (hidden > FEW_ROWS_MAX_HIDDEN) takes levels of at most this many tokens on the register kernel
# (`decode_linear`'s default at one or two rows): at one row it streams the 8B shape's bf16 weights faster than
# cuBLAS (session 14, the target's one-row step), while its tile kernel (more rows) does not (session 15).
LARGE_DRAFT_ROWS_MAX = 2


def draft_rows_max(draft: nn.Module) -> int:
    """The most tokens a tree level may have to take `forward_draft_rows`: FEW_ROWS_MAX where the tile kernels pay
    (`few_rows_pay`), else LARGE_DRAFT_ROWS_MAX (the register kernel alone). An FP8 draft's codes take the register
    kernel only, so at most its REGISTER_ROWS, and a large one's at most what its linears take there
    (`Fp8Linear.row_kernel_max_rows`: one row for a wide model's, session 44)."""
    from eyas.kernels.decode_linear import REGISTER_ROWS
    if not _is_fp8(draft.fc):
        return FEW_ROWS_MAX if few_rows_pay(draft) else LARGE_DRAFT_ROWS_MAX
    if few_rows_pay(draft):
        return min(FEW_ROWS_MAX, REGISTER_ROWS)
    return min(LARGE_DRAFT_ROWS_MAX, REGISTER_ROWS, draft.fc.row_kernel_max_rows())


def takes_draft_rows(draft: nn.Module, pairs: torch.Tensor, meta: AttentionMetadata | None) -> bool:
    """`pairs` [B, Q, 2H]: 1 to `few_rows_max` tokens of a tree level (their K/V go to the stash), with
    `draft.few_rows` set. The catch-up (K/V to the draft cache after attending among themselves) keeps the fused
    path."""
    return (getattr(draft, "few_rows", False) and meta is not None and meta.use_triton and meta.stash is not None
            and 1 <= pairs.shape[0] * pairs.shape[1] <= getattr(draft, "few_rows_max", FEW_ROWS_MAX)
            and pairs.dtype == draft.layers[0].post_attention_layernorm.weight.dtype)


def forward_draft_rows(draft: nn.Module, pairs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       cache, out: torch.Tensor | None = None) -> torch.Tensor:
    """An EAGLE draft's tree level on the same kernels: `EagleDraft.forward_pairs` for pairs [B, Q, 2H] (`out`: as
    there, written and returned). fc is one launch, then each layer the five of `forward_rows` (the first layer
    without the input norm), the last layer's down projection adding the residual straight into `out`."""
    from eyas.kernels.decode_linear import decode_linear
    B, Q, H2 = pairs.shape
    M, H = B * Q, H2 // 2
    pdl = use_pdl(pairs.device)
    w, sc = _row_weight(draft.fc)
    r = decode_linear(pairs.reshape(M, H2), w, pdl=pdl, scale=sc)           # the residual stream
    pos = positions.expand(B, Q).reshape(M)
    direct = out is not None and out.is_contiguous() and out.shape == (B, Q, H) and out.dtype == r.dtype
    last = len(draft.layers) - 1
    for i, layer in enumerate(draft.layers):
        _layer_rows(layer, r, B, Q, pos, meta, cache, draft.rope, pdl,
                    out=out.view(M, H) if i == last and direct else None)
    if direct:
        return out
    y = r.view(B, Q, H)
    return y if out is None else out.copy_(y)


def logits_one_row(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The head over one hidden row [..., H] -> [1, V] in the model dtype."""
    from eyas.kernels.decode_linear import decode_linear
    H = hidden.shape[-1]
    return decode_linear(hidden.reshape(-1, H), model.lm_head.weight, pdl=use_pdl(hidden.device))
