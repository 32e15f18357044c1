"""Triton SwiGLU: silu(gate) * up in one launch (the eager path takes two: silu, then mul).

`swiglu_triton(gate, up)`: gate and up [..., I], typically the two halves of a fused gate_up projection's output
[..., 2I] (strided views; only the last dimension must be contiguous). silu is computed in float32 and cast to
the model dtype, then multiplied by up in float32 and cast again: the roundings of eager `F.silu(gate) * up`.
Grid: (rows, column tiles of 1024). The reference is `swiglu_reference` below.

With `norm_x` (a model whose RMSNorm weights are folded into its projections, `eyas.models.fused.fold_norms`) gate
and up are the projections of the raw residual rows `norm_x`, and both are first multiplied (in float32) by
rsqrt(mean(x^2) + eps) of their row: the post-attention RMSNorm, without its own kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from eyas.kernels.fused_norm import row_rstd
from eyas.layers.norm import rms_scale


@triton.jit
def _swiglu_kernel(G, U, OUT, NX, n_cols, stride_g, stride_u, stride_o, stride_nx, n_hidden, eps,
                   BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_X: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # the RMSNorm of the raw residual row (its weight folded into gate_up)
        scale = row_rstd(NX + row * stride_nx, n_hidden, eps, BLOCK_X)
        g = g * scale
        u = u * scale
    s = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty)  # F.silu in the model dtype
    tl.store(OUT + row * stride_o + offs, (s.to(tl.float32) * u).to(OUT.dtype.element_ty), mask=mask)


def _norm_rows(norm_x, gate):
    if norm_x is None:
        return None
    if tuple(norm_x.shape[:-1]) != tuple(gate.shape[:-1]):
        raise ValueError(f"norm_x {tuple(norm_x.shape)} must hold one row per row of gate {tuple(gate.shape)}")
    nx = norm_x.reshape(-1, norm_x.shape[-1])
    return nx if nx.stride(-1) == 1 else nx.contiguous()


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, norm_x: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up [..., I] (new contiguous tensor). `norm_x` [..., hidden]: gate and up of
    each row are first multiplied by rsqrt(mean(norm_x row^2) + eps) (float32)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    nx = _norm_rows(norm_x, gate)
    I = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    g2, u2 = gate.reshape(-1, I), up.reshape(-1, I)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    N = g2.shape[0]
    if N == 0 or I == 0:
        return out
    o2 = out.view(-1, I)
    BLOCK = min(triton.next_power_of_2(I), 1024)
    has_norm = nx is not None
    nx = nx if has_norm else g2  # a placeholder, never read
    _swiglu_kernel[(N, triton.cdiv(I, BLOCK))](g2, u2, o2, nx, I, g2.stride(0), u2.stride(0), o2.stride(0),
                                               nx.stride(0), nx.shape[-1] if has_norm else 1, eps, BLOCK=BLOCK,
                                               HAS_NORM=has_norm,
                                               BLOCK_X=triton.next_power_of_2(nx.shape[-1]) if has_norm else 1,
                                               num_warps=4, enable_fp_fusion=False)
    return out


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, norm_x: torch.Tensor | None = None,
                     eps: float = 1e-6) -> torch.Tensor:
    """Plain-PyTorch reference of `swiglu_triton`: the eager MLP's `F.silu(gate) * up` (with `norm_x`: of gate and up
    scaled in float32 by the row's RMSNorm scale first, each cast back to the model dtype at the kernel's points)."""
    if norm_x is None:
        return F.silu(gate) * up
    _norm_rows(norm_x, gate)
    scale = rms_scale(norm_x, eps)[..., None]
    g, u = gate.float() * scale, up.float() * scale
    return (F.silu(g).to(gate.dtype).float() * u).to(torch.promote_types(gate.dtype, up.dtype))
