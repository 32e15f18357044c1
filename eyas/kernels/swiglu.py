"""Triton SwiGLU: silu(gate) * up in one launch (the eager path takes two: silu, then mul).

`swiglu_triton(gate, up)`: gate and up [..., I], typically the two halves of a fused gate_up projection's output
[..., 2I] (strided views; only the last dimension must be contiguous). silu is computed in float32 and cast to
the model dtype, then multiplied by up in float32 and cast again: the roundings of eager `F.silu(gate) * up`.
Grid: (rows, column tiles of 1024). The reference is `swiglu_reference` below.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _swiglu_kernel(G, U, OUT, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty)  # F.silu in the model dtype
    tl.store(OUT + row * stride_o + offs, (s.to(tl.float32) * u).to(OUT.dtype.element_ty), mask=mask)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up [..., I] (new contiguous tensor)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
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
    _swiglu_kernel[(N, triton.cdiv(I, BLOCK))](g2, u2, o2, I, g2.stride(0), u2.stride(0), o2.stride(0),
                                               BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    return out


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch reference of `swiglu_triton`: the eager MLP's `F.silu(gate) * up`."""
    return F.silu(gate) * up
