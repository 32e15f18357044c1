"""The step's last write in one launch: the accepted path's target features, as the draft reads them, into its
hidden-state buffer.

After acceptance, `spec_step` hands the draft the target's features along the accepted path (root first), so that
the next step's catch-up reads them: `dst[slots[b], j] = read_features(feats[b, max(path[b, j], 0)])` for every j
< D1 = path.shape[1] (rows past the accepted depth are written too, from the root's row, and never read). For a draft
with feature layers (EAGLE-3 style) `read_features` is the linear `fuse` ([H, F], no bias); for an EAGLE-1 draft it is
the identity. In PyTorch that is a clamp of the path, a gather of its rows, the `fuse` GEMM and an index_put: four
small kernels (three without `fuse`) at the end of every step. On CUDA one launch does them
(`commit_features_triton`): a program per (path row, BLOCK_N outputs) gathers its row, takes the dot products with
`fuse`'s rows in float32 and stores in the buffer's dtype. `eyas.spec.step.commit_features_reference` is what
`spec_step` runs otherwise (it lives there so that the model runs without Triton); the tests hold the two equal.

Switch: `eyas.spec.step.FUSED_FEATURE_COMMIT` (off: written in session 41 without device time to measure it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import gdc_prologue, pdl_on
from eyas.spec.step import commit_features_reference  # noqa: F401 (the reference, exported beside)

# Programmatic dependent launch: each program lets the next kernel launch, then waits for the previous one (the
# acceptance, which wrote the path) before it reads.
PDL = True
BLOCK_N = 16  # outputs a program takes with `fuse` (its rows of `fuse` streamed in BLOCK_K-wide tiles)
BLOCK_K = 256


@triton.jit
def _commit_features_kernel(FEATS, PATH, SLOTS, W, DST, D1, F, H,
                            stride_fb, stride_fn, stride_ff, stride_pb, stride_pj, stride_wn, stride_wk,
                            stride_ds, stride_dr, stride_dh,
                            HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    pid = tl.program_id(0)
    b = (pid // D1).to(tl.int64)
    j = (pid % D1).to(tl.int64)
    node = tl.maximum(tl.load(PATH + b * stride_pb + j * stride_pj).to(tl.int64), 0)
    slot = tl.load(SLOTS + b).to(tl.int64)
    src = FEATS + b * stride_fb + node * stride_fn
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    if HAS_W:  # y = fuse(x): x cast to the weight's dtype first, products summed in float32, y in the weight's dtype
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < F
            x = tl.load(src + offs_k * stride_ff, mask=k_ok, other=0.0).to(W.dtype.element_ty).to(tl.float32)
            w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        y = acc.to(W.dtype.element_ty)
    else:  # the row itself
        y = tl.load(src + offs_n * stride_ff, mask=n_ok, other=0.0)
    tl.store(DST + slot * stride_ds + j * stride_dr + offs_n * stride_dh, y.to(DST.dtype.element_ty), mask=n_ok)


def check_commit_features(feats: torch.Tensor, path: torch.Tensor, weight: torch.Tensor | None,
                          slots: torch.Tensor, dst: torch.Tensor) -> None:
    B, N1, F = feats.shape
    if path.dim() != 2 or path.shape[0] != B or slots.shape != (B,):
        raise ValueError(f"path {tuple(path.shape)} and slots {tuple(slots.shape)} must be [B, D1] and [B], B = {B}")
    H = weight.shape[0] if weight is not None else F
    if weight is not None and (weight.dim() != 2 or weight.shape[1] != F):
        raise ValueError(f"weight {tuple(weight.shape)} must be [H, {F}]")
    if dst.dim() != 3 or dst.shape[2] != H or dst.shape[1] < path.shape[1]:
        raise ValueError(f"dst {tuple(dst.shape)} must be [slots, >= {path.shape[1]}, {H}]")


def commit_features_triton(feats: torch.Tensor, path: torch.Tensor, weight: torch.Tensor | None,
                           slots: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[slots[b], j] = (weight @ feats[b, max(path[b, j], 0)]) for j < path.shape[1], or the row itself where
    `weight` is None (module docstring). feats [B, N1, F]; path [B, D1] (-1 past the accepted depth); weight [H, F]
    or None; slots [B]; dst [S, R >= D1, H]. In place, one launch."""
    check_commit_features(feats, path, weight, slots, dst)
    B, D1 = path.shape
    H = dst.shape[2]
    if B * D1 == 0:
        return
    if weight is not None:
        block_n, block_k = BLOCK_N, min(BLOCK_K, triton.next_power_of_2(feats.shape[2]))
    else:
        block_n, block_k = min(1024, triton.next_power_of_2(H)), 1
    use_gdc, pdl = pdl_on(PDL, feats.device)
    w = weight if weight is not None else feats
    _commit_features_kernel[(B * D1, triton.cdiv(H, block_n))](
        feats, path, slots, w, dst, D1, feats.shape[2], H,
        *feats.stride(), *path.stride(), *((weight.stride()) if weight is not None else (0, 0)), *dst.stride(),
        HAS_W=weight is not None, BLOCK_N=block_n, BLOCK_K=block_k, USE_GDC=use_gdc, num_warps=4, **pdl,
    )
