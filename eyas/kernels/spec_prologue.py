"""The speculative step's index work around the draft's catch-up, in two launches instead of ~9 small PyTorch kernels.

`step_indices_triton(root_tokens, n, lens, depth, P)` (one launch, before the catch-up): for each sequence b
* `node_tokens [B, N+1]` with column 0 = root_tokens[b] (the tree levels fill the other columns),
* `positions [B, N+1]` = n[b] + depth[j] (root and tree in the target) and `draft_positions` = positions - 1 (a node
  of depth d sits at draft position n-1+d),
* `mask [B, P, P]` (bool): the catch-up's causal mask among the first lens[b] pairs, a padded row seeing itself
  (`eyas.spec.drafter.causal_mask`).
`root_row_triton(out, lens, dst)` (one launch, after it): dst[b] = out[b, max(lens[b] - 1, 0)], the last pair's draft
output, the root's feature.

Both are programmatic dependent launches when `PDL` is on (each program lets the next kernel launch, then waits), so
the draft head after the root row can load its weights while the row is copied. References (plain PyTorch, the
functions `eyas.spec.step.spec_step` runs without them): `step_indices_reference`, `root_row_reference`.
Tests: tests/test_spec_prologue.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import gdc_prologue, pdl_on
# the references, the ops `spec_step` runs without the kernels (kept out of this module so that the model runs
# without Triton), exported beside
from eyas.spec.step import root_row_reference, step_indices_reference  # noqa: F401

PDL = True  # the launches' PDL where the GPU has it (sm_90); the switch that takes them is eyas.spec.step's


@triton.jit
def _step_indices_kernel(ROOT, NCACHED, LENS, DEPTH, NODE_TOK, POS, DPOS, MASK, N1, P,
                         stride_nt, stride_pos, stride_mb, BLOCK_N1: tl.constexpr, BLOCK_P: tl.constexpr,
                         USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    b = tl.program_id(0).to(tl.int64)
    root = tl.load(ROOT + b)
    tl.store(NODE_TOK + b * stride_nt, root.to(NODE_TOK.dtype.element_ty))
    n = tl.load(NCACHED + b).to(tl.int64)
    j = tl.arange(0, BLOCK_N1)
    ok = j < N1
    pos = n + tl.load(DEPTH + j, mask=ok, other=0).to(tl.int64)
    tl.store(POS + b * stride_pos + j, pos.to(POS.dtype.element_ty), mask=ok)
    tl.store(DPOS + b * stride_pos + j, (pos - 1).to(DPOS.dtype.element_ty), mask=ok)
    ln = tl.load(LENS + b).to(tl.int64)
    r = tl.arange(0, BLOCK_P)
    i2 = r[:, None]
    j2 = r[None, :]
    see = ((j2 <= i2) & (j2 < ln)) | (i2 == j2)
    tl.store(MASK + b * stride_mb + i2 * P + j2, see.to(MASK.dtype.element_ty), mask=(i2 < P) & (j2 < P))


@triton.jit
def _root_row_kernel(OUT, LENS, DST, H, stride_ob, stride_op, stride_db, BLOCK_H: tl.constexpr,
                     USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    b = tl.program_id(0).to(tl.int64)
    row = tl.maximum(tl.load(LENS + b).to(tl.int64) - 1, 0)
    src = OUT + b * stride_ob + row * stride_op
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        ok = offs < H
        tl.store(DST + b * stride_db + offs, tl.load(src + offs, mask=ok, other=0.0), mask=ok)


def step_indices_triton(root_tokens: torch.Tensor, n: torch.Tensor, lens: torch.Tensor, depth: torch.Tensor,
                        P: int):
    """One launch (module docstring); the outputs of `step_indices_reference`. depth [N+1] on the device."""
    B, N1 = root_tokens.shape[0], depth.shape[0]
    if root_tokens.dim() != 1 or n.shape != (B,) or lens.shape != (B,) or depth.dim() != 1 or P < 1:
        raise ValueError(f"step_indices: root_tokens [B], n [B], lens [B], depth [N+1] and P >= 1, got "
                         f"{tuple(root_tokens.shape)}, {tuple(n.shape)}, {tuple(lens.shape)}, {tuple(depth.shape)}, "
                         f"P={P}")
    dev = root_tokens.device
    node_tokens = torch.empty(B, N1, dtype=torch.long, device=dev)
    positions = torch.empty(B, N1, dtype=n.dtype, device=dev)
    draft_positions = torch.empty(B, N1, dtype=n.dtype, device=dev)
    mask = torch.empty(B, P, P, dtype=torch.bool, device=dev)
    if B:
        use_gdc, launch = pdl_on(PDL, dev)
        _step_indices_kernel[(B,)](root_tokens, n, lens, depth, node_tokens, positions, draft_positions, mask, N1, P,
                                   node_tokens.stride(0), positions.stride(0), mask.stride(0),
                                   BLOCK_N1=triton.next_power_of_2(N1), BLOCK_P=max(2, triton.next_power_of_2(P)),
                                   USE_GDC=use_gdc, num_warps=1, **launch)
    return node_tokens, positions, draft_positions, mask


def root_row_triton(out: torch.Tensor, lens: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst [B, H] (a view may do: its last dimension contiguous) = `root_row_reference(out, lens)`; returns dst."""
    B, P, H = out.shape
    if lens.shape != (B,) or dst.shape != (B, H) or out.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError(f"root_row: out [B, P, H] and dst [B, H] with contiguous rows, lens [B]; got "
                         f"{tuple(out.shape)}, {tuple(dst.shape)}, {tuple(lens.shape)}")
    if B:
        use_gdc, launch = pdl_on(PDL, out.device)
        _root_row_kernel[(B,)](out, lens, dst, H, out.stride(0), out.stride(1), dst.stride(0),
                               BLOCK_H=min(1024, triton.next_power_of_2(H)), USE_GDC=use_gdc, num_warps=4, **launch)
    return dst
