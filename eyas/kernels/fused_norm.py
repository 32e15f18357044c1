"""Triton fused residual add + RMSNorm (one launch instead of ~8 for the eager float32 RMSNorm and its add).

`add_rms_norm_triton(x, residual, weight, eps) -> (normed, new_residual)`:

* new_residual = x + residual, in the input dtype (the eager model adds the residual stream in the model dtype);
  with `residual=None` it is `x` itself (no copy).
* normed = weight * (r.float() * rsqrt(mean(r.float()^2) + eps)).to(dtype), r = new_residual: exactly the order of
  operations of `eyas.layers.norm.rms_norm` (HF Llama's), so greedy outputs do not move. Only the sum of squares is
  reduced in another order (a few float32 ulps).

One program per row of the last dimension (the whole row in one tile, H <= 16k). The reference is
`add_rms_norm_reference` below.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.layers.norm import rms_norm


@triton.jit
def row_rstd(X, n_cols, eps, BLOCK: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of the row of n_cols at X, in float32: an RMSNorm's scale (for kernels that apply a
    norm whose weight is folded into the projection before them: `fused_rope`, `swiglu`)."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
    return tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)


@triton.jit
def _add_rms_norm_kernel(X, R, W, OUT, RES_OUT, n_cols, stride_x, stride_r, stride_o, stride_ro, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(RES_OUT.dtype.element_ty)  # the add in the model dtype
        tl.store(RES_OUT + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.math.rsqrt(var + eps)).to(X.dtype.element_ty)  # x.to(dtype) before the weight, as the reference
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(OUT + row * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(OUT.dtype.element_ty),
             mask=mask)


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    t = t.reshape(-1, H)
    return t if t.stride(-1) == 1 else t.contiguous()


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        res_out: torch.Tensor | None = None):
    """x, residual [..., H] (same shape and dtype; residual may be None), weight [H] -> (normed, new_residual).
    `res_out` (contiguous, x's shape and dtype; with a residual): where new_residual is written (and returned)."""
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit rows of {H}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} differs from x {tuple(x.shape)} "
                         f"{x.dtype}")
    x2 = _rows(x, H)
    N = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if res_out is not None and (residual is None or res_out.shape != x.shape or res_out.dtype != x.dtype
                                or not res_out.is_contiguous()):
        raise ValueError("res_out needs a residual, x's shape and dtype, and contiguous memory")
    new_res = x if residual is None else (torch.empty(x.shape, dtype=x.dtype, device=x.device) if res_out is None
                                          else res_out)
    if N == 0:
        return out, new_res
    r2 = _rows(residual, H) if residual is not None else x2
    o2 = out.view(-1, H)
    nr2 = new_res.view(-1, H) if residual is not None else x2  # not written without a residual
    BLOCK = triton.next_power_of_2(H)
    _add_rms_norm_kernel[(N,)](
        x2, r2, weight, o2, nr2, H, x2.stride(0), r2.stride(0), o2.stride(0), nr2.stride(0), eps,
        HAS_RES=residual is not None, BLOCK=BLOCK, num_warps=min(max(BLOCK // 256, 1), 16),
        enable_fp_fusion=False,
    )
    return out, new_res


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """Plain-PyTorch reference of `add_rms_norm_triton`: the eager model's `x = x + f(...)` then `RMSNorm`."""
    r = x if residual is None else residual + x
    return rms_norm(r, weight, eps), r
