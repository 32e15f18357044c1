"""Triton RoPE: q [..., H, D] and k [..., KVH, D] rotated in one launch (instead of ~20 eager kernels: gathers of
the tables, float upcasts, chunk/cat of rotate_half, muls, adds, casts).

It reads the module's float32 cos/sin tables [max_positions, D] at integer positions [...], computes in float32
and casts back, with the rotate_half convention (first half / second half of each head):
out1 = x1 * cos1 - x2 * sin1, out2 = x2 * cos2 + x1 * sin2 — the exact float32 operations of
`eyas.layers.rotary.RotaryEmbedding.forward` (FMA contraction is off, so the roundings are the same).

One program per token: all its query and key heads. q and k may be strided views (e.g. of a fused qkv output) as
long as the head dimension is contiguous; the outputs are new contiguous tensors. The reference is
`rope_reference` below.

`rope_store_triton` is the same rotation with the K/V store fused in, for the steps whose new K/V go straight to
storage: plain decoding (to the paged cache, by slot) and tree tokens (to the step's stash, by node). It returns only
the rotated q, stores rotated k and v, and so replaces two launches (RoPE, then the K/V write) by one. Its reference is
`rope_store_reference`. With `norm_x` (a model whose RMSNorm weights are folded into its projections,
`eyas.models.fused.fold_norms`) it also applies the input RMSNorm: q, k and v are the projections of the raw residual
rows `norm_x`, and each token's q, k and v are multiplied by rsqrt(mean(x^2) + eps) of its row before the rotation,
so the norm kernel before the projection is gone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.fused_norm import row_rstd
from eyas.kernels.interpret import gdc_prologue, pdl_launch
from eyas.layers.attention import store_rows
from eyas.layers.norm import rms_scale
from eyas.layers.rotary import rotate_half


@triton.jit
def _rotate_heads(X, XO, n, stride_xn, stride_xh, stride_on, stride_oh, c1, c2, s1, s2, offs_d, mask_d,
                  NH: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, scale=None):
    """Rotate heads 0..NH-1 of token n of X into XO; `scale` (float32, optional): multiply x by it first."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NH)[:, None] & mask_d[None, :]
    src = X + n * stride_xn + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if scale is not None:
        x1 = x1 * scale
        x2 = x2 * scale
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    dst = XO + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, o1.to(XO.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(XO.dtype.element_ty), mask=mask)


@triton.jit
def _angles(COS, SIN, pos, stride_cos, stride_sin, offs_d, mask_d, HALF: tl.constexpr):
    """The cos/sin table rows of position `pos`, as first and second halves."""
    c1 = tl.load(COS + pos * stride_cos + offs_d, mask=mask_d, other=0.0)
    c2 = tl.load(COS + pos * stride_cos + HALF + offs_d, mask=mask_d, other=0.0)
    s1 = tl.load(SIN + pos * stride_sin + offs_d, mask=mask_d, other=0.0)
    s2 = tl.load(SIN + pos * stride_sin + HALF + offs_d, mask=mask_d, other=0.0)
    return c1, c2, s1, s2


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
    c1, c2, s1, s2 = _angles(COS, SIN, pos, stride_cos, stride_sin, offs_d, mask_d, HALF)
    _rotate_heads(Q, QO, n, stride_qn, stride_qh, stride_qon, stride_qoh, c1, c2, s1, s2, offs_d, mask_d,
                  NQ, HALF, BLOCK_Q)
    _rotate_heads(K, KO, n, stride_kn, stride_kh, stride_kon, stride_koh, c1, c2, s1, s2, offs_d, mask_d,
                  NK, HALF, BLOCK_K)


@triton.jit
def _rope_store_kernel(Q, K, V, QO, KD, VD, POS, ROWS, COS, SIN, NX,
                       num_q, seq_rows, row_offset,
                       stride_qb, stride_qq, stride_qh, stride_kb, stride_kq, stride_kh,
                       stride_vb, stride_vq, stride_vh, stride_qob, stride_qoq, stride_qoh,
                       stride_kdr, stride_kdh, stride_vdr, stride_vdh, stride_pb, stride_pq, stride_rb, stride_rq,
                       stride_cos, stride_sin, stride_nxb, stride_nxq, n_hidden, eps,
                       NQ: tl.constexpr, NK: tl.constexpr, HALF: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROWS: tl.constexpr,
                       HAS_NORM: tl.constexpr, BLOCK_X: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_prologue(USE_GDC)  # PDL: the next kernel (the attention) launches now; wait for the previous one's writes
    pid = tl.program_id(0)
    b = (pid // num_q).to(tl.int64)
    j = (pid % num_q).to(tl.int64)
    scale = None
    if HAS_NORM:  # the input RMSNorm of the raw residual row (its weight folded into the projection)
        scale = row_rstd(NX + b * stride_nxb + j * stride_nxq, n_hidden, eps, BLOCK_X)
    pos = tl.load(POS + b * stride_pb + j * stride_pq).to(tl.int64)
    if HAS_ROWS:  # destination rows given (cache slots); < 0: do not store
        row = tl.load(ROWS + b * stride_rb + j * stride_rq).to(tl.int64)
    else:  # the stash: row b * seq_rows + row_offset + j
        row = b * seq_rows + row_offset + j
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    c1, c2, s1, s2 = _angles(COS, SIN, pos, stride_cos, stride_sin, offs_d, mask_d, HALF)
    # q: token (b, j) of Q to row b * num_q + j of the contiguous output
    _rotate_heads(Q + b * stride_qb + j * stride_qq, QO + b * stride_qob + j * stride_qoq, 0, 0, stride_qh, 0,
                  stride_qoh, c1, c2, s1, s2, offs_d, mask_d, NQ, HALF, BLOCK_Q, scale)
    # k and v: to the destination row (a masked-out row stores nothing; row 0 keeps the addresses in bounds)
    ok_d = mask_d & ((offs_d * 0 + row) >= 0)
    row = tl.maximum(row, 0)
    _rotate_heads(K + b * stride_kb + j * stride_kq, KD + row * stride_kdr, 0, 0, stride_kh, 0, stride_kdh,
                  c1, c2, s1, s2, offs_d, ok_d, NK, HALF, BLOCK_K, scale)
    offs_h = tl.arange(0, BLOCK_K)
    vmask = (offs_h < NK)[:, None] & ok_d[None, :]
    src = V + b * stride_vb + j * stride_vq + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = VD + row * stride_vdr + offs_h[:, None] * stride_vdh + offs_d[None, :]
    v1 = tl.load(src, mask=vmask, other=0.0)
    v2 = tl.load(src + HALF, mask=vmask, other=0.0)
    if HAS_NORM:
        v1 = v1.to(tl.float32) * scale
        v2 = v2.to(tl.float32) * scale
    tl.store(dst, v1.to(VD.dtype.element_ty), mask=vmask)
    tl.store(dst + HALF, v2.to(VD.dtype.element_ty), mask=vmask)


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


def _store_args(positions, q, k, v, k_dst, v_dst, rows, seq_rows, row_offset):
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, Q, heads, D] "
                         "with k and v alike")
    if k_dst.dim() != 3 or v_dst.shape != k_dst.shape or tuple(k_dst.shape[1:]) != tuple(k.shape[2:]):
        raise ValueError(f"destinations {tuple(k_dst.shape)}/{tuple(v_dst.shape)} must be [rows, "
                         f"{k.shape[2]}, {k.shape[3]}]")
    B, NQ = q.shape[:2]
    if rows is not None and tuple(rows.shape) != (B, NQ):
        raise ValueError(f"rows {tuple(rows.shape)}, expected {(B, NQ)}")
    if rows is None and (seq_rows is None or row_offset + NQ > seq_rows or B * seq_rows > k_dst.shape[0]):
        raise ValueError(f"without rows, sequence b stores at b * seq_rows + row_offset + j: seq_rows={seq_rows}, "
                         f"row_offset={row_offset} do not fit {NQ} tokens x {B} sequences in {k_dst.shape[0]} rows")
    return positions.expand(B, NQ)


def _norm_args(norm_x, q):
    if norm_x is not None and (norm_x.dim() != 3 or tuple(norm_x.shape[:2]) != tuple(q.shape[:2])
                               or norm_x.stride(-1) != 1):
        raise ValueError(f"norm_x {tuple(norm_x.shape)} must be [B, Q, hidden] rows (contiguous) of the "
                         f"{tuple(q.shape[:2])} tokens")


def rope_store_triton(positions, q, k, v, cos, sin, k_dst, v_dst, rows=None, seq_rows=None, row_offset=0,
                      norm_x=None, eps=1e-6, pdl=False):
    """RoPE on q [B, Q, H, D] and k [B, Q, KVH, D] at positions [B, Q] (or broadcastable), then k (rotated) and v
    [B, Q, KVH, D] stored into the row stores k_dst/v_dst [R, KVH, D], in their dtype. Token (b, j) goes to row
    rows[b, j] (skipped when < 0), or, without `rows`, to row b * seq_rows + row_offset + j. Returns the rotated q,
    a new tensor. A paged cache layer [blocks, block_size, KVH, D] is a row store through `.view(-1, KVH, D)`, its
    rows the flat slots. `norm_x` [B, Q, hidden]: q, k and v of token (b, j) are first multiplied (in float32) by
    rsqrt(mean(norm_x[b, j]^2) + eps), the RMSNorm of the projections' input (its weight folded into them).
    `pdl`: launch with programmatic dependent launch (CUDA, sm_90+; not under TRITON_INTERPRET): the kernel lets the
    next one launch at once and waits for the previous one before it reads anything."""
    positions = _store_args(positions, q, k, v, k_dst, v_dst, rows, seq_rows, row_offset)
    _norm_args(norm_x, q)
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != q.shape[-1]:
        raise ValueError(f"cos/sin tables {tuple(cos.shape)}/{tuple(sin.shape)} must be [max_positions, "
                         f"{q.shape[-1]}]")
    B, NQ, H, D = q.shape
    KVH = k.shape[2]
    if D % 2:
        raise ValueError(f"head dim {D} is odd")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B * NQ == 0:
        return q_out
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (k_dst, "k_dst"), (v_dst, "v_dst")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous head dimension")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    has_rows, has_norm = rows is not None, norm_x is not None
    r = rows if has_rows else positions  # a placeholder, never read
    nx = norm_x if has_norm else q  # likewise
    use_gdc, launch = pdl_launch(pdl)
    _rope_store_kernel[(B * NQ,)](
        q, k, v, q_out, k_dst, v_dst, positions, r, cos, sin, nx,
        NQ, seq_rows or 0, row_offset,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1),
        positions.stride(0), positions.stride(1), r.stride(0), r.stride(1), cos.stride(0), sin.stride(0),
        nx.stride(0), nx.stride(1), nx.shape[-1] if has_norm else 1, eps,
        NQ=H, NK=KVH, HALF=D // 2, BLOCK_Q=triton.next_power_of_2(H), BLOCK_K=triton.next_power_of_2(KVH),
        BLOCK_D=triton.next_power_of_2(D // 2), HAS_ROWS=has_rows, HAS_NORM=has_norm,
        BLOCK_X=triton.next_power_of_2(nx.shape[-1]) if has_norm else 1, USE_GDC=use_gdc, num_warps=4,
        enable_fp_fusion=False, **launch,
    )
    return q_out


def rope_store_reference(positions, q, k, v, cos, sin, k_dst, v_dst, rows=None, seq_rows=None, row_offset=0,
                         norm_x=None, eps=1e-6):
    """Plain-PyTorch reference of `rope_store_triton` (same arguments and result; rows < 0 go to the scratch row 0,
    which the kernel leaves alone: `eyas.layers.attention.store_rows`)."""
    positions = _store_args(positions, q, k, v, k_dst, v_dst, rows, seq_rows, row_offset)
    _norm_args(norm_x, q)
    scale = None if norm_x is None else rms_scale(norm_x, eps)[..., None, None]  # [B, Q, 1, 1]
    q, k = rope_reference(positions, q, k, cos, sin, scale)
    if scale is not None:
        v = (v.float() * scale).to(v.dtype)
    store_rows(k_dst, v_dst, k, v, rows, seq_rows, row_offset)
    return q


def rope_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   scale: torch.Tensor | None = None):
    """Plain-PyTorch reference of `rope_triton`: `RotaryEmbedding.forward` on explicit tables (`scale`, float32
    broadcastable to q and k: multiplied into both before the rotation)."""
    c = cos[positions].unsqueeze(-2)
    s = sin[positions].unsqueeze(-2)
    qf, kf = q.float(), k.float()
    if scale is not None:
        qf, kf = qf * scale, kf * scale
    return (qf * c + rotate_half(qf) * s).to(q.dtype), (kf * c + rotate_half(kf) * s).to(k.dtype)
