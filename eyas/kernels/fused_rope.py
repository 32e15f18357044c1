"""Triton RoPE: q [..., H, D] and k [..., KVH, D] rotated in one launch (instead of ~20 eager kernels: gathers of
the tables, float upcasts, chunk/cat of rotate_half, muls, adds, casts).

It reads the module's float32 cos/sin tables [max_positions, D] at integer positions [...], computes in float32
and casts back, with the rotate_half convention (first half / second half of each head):
out1 = x1 * cos1 - x2 * sin1, out2 = x2 * cos2 + x1 * sin2 — the exact float32 operations of
`eyas.layers.rotary.RotaryEmbedding.forward` (FMA contraction is off, so the roundings are the same).

One program per token: all its query and key heads. q and k may be strided views (e.g. of a fused qkv output) as
long as the head dimension is contiguous; the outputs are new contiguous tensors. The reference is
`rope_reference` below.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.layers.rotary import rotate_half


@triton.jit
def _rotate_heads(X, XO, n, stride_xn, stride_xh, stride_on, stride_oh, c1, c2, s1, s2, offs_d, mask_d,
                  NH: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NH)[:, None] & mask_d[None, :]
    src = X + n * stride_xn + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    dst = XO + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, o1.to(XO.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(XO.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, QO, KO, POS, COS, SIN,
                 stride_qn, stride_qh, stride_kn, stride_kh, stride_qon, stride_qoh, stride_kon, stride_koh,
                 stride_cos, stride_sin,
                 NQ: tl.constexpr, NK: tl.constexpr, HALF: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + n).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    c1 = tl.load(COS + pos * stride_cos + offs_d, mask=mask_d, other=0.0)
    c2 = tl.load(COS + pos * stride_cos + HALF + offs_d, mask=mask_d, other=0.0)
    s1 = tl.load(SIN + pos * stride_sin + offs_d, mask=mask_d, other=0.0)
    s2 = tl.load(SIN + pos * stride_sin + HALF + offs_d, mask=mask_d, other=0.0)
    _rotate_heads(Q, QO, n, stride_qn, stride_qh, stride_qon, stride_qoh, c1, c2, s1, s2, offs_d, mask_d,
                  NQ, HALF, BLOCK_Q)
    _rotate_heads(K, KO, n, stride_kn, stride_kh, stride_kon, stride_koh, c1, c2, s1, s2, offs_d, mask_d,
                  NK, HALF, BLOCK_K)


def _tokens(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, *t.shape[-2:])
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """positions [...] (integers, broadcastable to q's leading dims), q [..., H, D], k [..., KVH, D], cos/sin
    [max_positions, D] float32 -> rotated (q, k), new tensors of q's and k's dtypes. Positions are not range-checked
    (the tables have a margin)."""
    D = q.shape[-1]
    lead = tuple(q.shape[:-2])
    if D % 2 or k.shape[-1] != D or tuple(k.shape[:-2]) != lead:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not fit together")
    positions = positions.expand(lead)  # broadcasts as the reference's table gather does
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D:
        raise ValueError(f"cos/sin tables {tuple(cos.shape)}/{tuple(sin.shape)} must be [max_positions, {D}]")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    N = positions.numel()
    if N == 0:
        return q_out, k_out
    q3, k3 = _tokens(q), _tokens(k)
    qo3, ko3 = q_out.view(N, *q.shape[-2:]), k_out.view(N, *k.shape[-2:])
    pos = positions.reshape(-1).contiguous()
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    H, KVH = q.shape[-2], k.shape[-2]
    _rope_kernel[(N,)](
        q3, k3, qo3, ko3, pos, cos, sin,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), qo3.stride(0), qo3.stride(1), ko3.stride(0),
        ko3.stride(1), cos.stride(0), sin.stride(0),
        NQ=H, NK=KVH, HALF=D // 2, BLOCK_Q=triton.next_power_of_2(H), BLOCK_K=triton.next_power_of_2(KVH),
        BLOCK_D=triton.next_power_of_2(D // 2), num_warps=4, enable_fp_fusion=False,
    )
    return q_out, k_out


def rope_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Plain-PyTorch reference of `rope_triton`: `RotaryEmbedding.forward` on explicit tables."""
    c = cos[positions].unsqueeze(-2)
    s = sin[positions].unsqueeze(-2)
    qf, kf = q.float(), k.float()
    return (qf * c + rotate_half(qf) * s).to(q.dtype), (kf * c + rotate_half(kf) * s).to(k.dtype)
