"""Triton GEMV over INT4 weights for batch-1..16 decode: out[M, N] = x[M, K] @ W[N, K]^T, with W stored as
`eyas.layers.linear_int4` stores it: 4-bit codes two per byte (`qweight` uint8 [N, K/2], column 2j in the high
nibble, 2j+1 in the low one) and per group of `group_size` columns a scale and a zero (`scales_and_zeros`
[K/group_size, N, 2]), w = (q - 8) * scale + zero.

Why beside PyTorch's own int4 kernel (`_weight_int4pack_mm`, "tinygemm", which `Int4Linear` runs): that kernel was
written for A100, and gpt-fast's README (A100-80GB limited to 330 W, batch 1, Llama-2-7B) reports its int4 path
at 863 GB/s of weight bytes against 1,397 GB/s for bf16. An INT4 draft head pays only if its bytes stream at more
than a quarter of the bf16 rate.
This kernel is the other candidate; `tools/diag/gemv_int4_bench.py` times both against cuBLAS bf16 on the GPU.

One group per k-step. Grid (cdiv(N, BLOCK_N), SPLIT_K): program (pid_n, pid_k) owns weight rows
[pid_n * BLOCK_N, +BLOCK_N) and a range of whole groups. Per group it loads the [BLOCK_N, group_size / 2] bytes
(contiguous per row), splits them into the even and odd columns' codes, and uses

    sum_k w[n, k] x[m, k] = scale[n] * sum_k (q[n, k] - 8) x[m, k] + zero[n] * sum_k x[m, k]

so the codes are never scaled one by one: per group, one [BLOCK_N, M] partial product and one scale/zero pair per
row. Float32 accumulation. Split-K programs write float32 partials that `_splitk_reduce_kernel` (eyas.kernels.gemv)
adds in a fixed order. Graph-capturable: the config is a pure function of the shapes.

`gemv_int4_reference`: dequantise (float32), then x @ W^T, cast to x.dtype. Tests: tests/test_int4.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.gemv import _REDUCE_BLOCK, MAX_M, NUM_SMS_H200, _splitk_reduce_kernel


@triton.jit
def _gemv_int4_kernel(X, QW, SZ, OUT, WS, M, N, K, GROUPS_PER_SPLIT, stride_xm, stride_qn, stride_om,
                      M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = GROUP // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_j = tl.arange(0, HALF)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows_w = tl.where(n_ok, offs_n, 0).to(tl.int64)  # out-of-range rows read row 0; never stored
    rows_x = tl.where(m_ok, offs_m, 0)
    q_ptrs = QW + rows_w[:, None] * stride_qn + offs_j[None, :]            # [BLOCK_N, HALF] bytes of one group
    x_ptrs = X + rows_x[:, None] * stride_xm + 2 * offs_j[None, :]         # [M_PAD, HALF] even columns
    n_groups = K // GROUP
    g_lo = pid_k * GROUPS_PER_SPLIT
    g_hi = tl.minimum(g_lo + GROUPS_PER_SPLIT, n_groups)
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    for g in range(g_lo, g_hi):
        b = tl.load(q_ptrs + g * HALF).to(tl.int32)                          # the weight stream: read once
        hi = ((b >> 4) - 8).to(tl.float32)                                  # column 2j
        lo = ((b & 15) - 8).to(tl.float32)                                  # column 2j + 1
        xe = tl.load(x_ptrs + g * GROUP, mask=m_ok[:, None], other=0.0).to(tl.float32)
        xo = tl.load(x_ptrs + g * GROUP + 1, mask=m_ok[:, None], other=0.0).to(tl.float32)
        part = tl.sum(hi[:, None, :] * xe[None, :, :] + lo[:, None, :] * xo[None, :, :], axis=2)  # [BLOCK_N, M_PAD]
        xsum = tl.sum(xe + xo, axis=1)                                      # [M_PAD]
        sz = SZ + (g * N + rows_w) * 2
        scale = tl.load(sz).to(tl.float32)
        zero = tl.load(sz + 1).to(tl.float32)
        acc += scale[:, None] * part + zero[:, None] * xsum[None, :]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        ws_ptrs = WS + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(ws_ptrs, acc, mask=mask)
    else:
        out_ptrs = OUT + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


def default_int4_config(M: int, N: int, K: int, group_size: int, num_sms: int = NUM_SMS_H200) -> tuple[int, int]:
    """(BLOCK_N, SPLIT_K): a pure function of the shapes. BLOCK_N keeps the [BLOCK_N, M_PAD, group/2] product at
    4096 elements; split-K (powers of two, at most 16, >= 2 groups per split) until >= 3 programs per SM. Guesses;
    the H200 sweep of tools/diag/gemv_int4_bench.py found configs at most ~7% faster (bench/int4_gemv_s12.json)."""
    m_pad = triton.next_power_of_2(M)
    block_n = max(1, min(4096 // (m_pad * (group_size // 2)), triton.next_power_of_2(N)))
    n_tiles = triton.cdiv(N, block_n)
    groups = K // group_size
    split = 1
    while n_tiles * split < 3 * num_sms and split < 16 and groups // (split * 2) >= 2:
        split *= 2
    return block_n, split


def gemv_int4_triton(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                     block_n: int | None = None, split_k: int | None = None, num_warps: int = 4,
                     num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (M <= 16, contiguous last dim), qweight uint8 [N, K/2] contiguous, scales_and_zeros [K/group, N, 2]
    contiguous -> [M, N] in x.dtype, float32 accumulation."""
    if x.dim() != 2 or qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError("gemv_int4_triton expects x [M, K] and qweight uint8 [N, K/2]")
    M, K = x.shape
    N = qweight.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"gemv_int4_triton supports 1 <= M <= {MAX_M} rows of x, got {M}")
    if qweight.shape[1] * 2 != K or K % group_size or group_size < 2 or group_size & (group_size - 1):
        raise ValueError(f"gemv_int4_triton: x has K = {K}, qweight {tuple(qweight.shape)}, group size "
                         f"{group_size} (a power of two dividing K)")
    if scales_and_zeros.shape != (K // group_size, N, 2) or not scales_and_zeros.is_contiguous():
        raise ValueError(f"gemv_int4_triton: scales_and_zeros must be contiguous [{K // group_size}, {N}, 2]")
    if x.stride(1) != 1 or not qweight.is_contiguous():
        raise ValueError("gemv_int4_triton needs x with a contiguous last dimension and a contiguous qweight")
    bn, sk = default_int4_config(M, N, K, group_size)
    block_n, split_k = block_n or bn, split_k or sk
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    groups = K // group_size
    per_split = triton.cdiv(groups, split_k)
    split_k = triton.cdiv(groups, per_split)
    ws = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 else out
    grid = (triton.cdiv(N, block_n), split_k)
    _gemv_int4_kernel[grid](x, qweight, scales_and_zeros, out, ws, M, N, K, per_split, x.stride(0),
                            qweight.stride(0), out.stride(0), M_PAD=triton.next_power_of_2(M), BLOCK_N=block_n,
                            GROUP=group_size, SPLIT=split_k > 1, num_warps=num_warps, num_stages=num_stages)
    if split_k > 1:
        _splitk_reduce_kernel[(M, triton.cdiv(N, _REDUCE_BLOCK))](ws, out, out, M, N, split_k, out.stride(0),
                                                                  HAS_BIAS=False, BLOCK=_REDUCE_BLOCK, num_warps=4)
    return out


def gemv_int4_reference(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """Plain PyTorch: the codes unpacked and dequantised in float32, then x @ W^T, cast to x.dtype."""
    from eyas.layers.linear_int4 import dequantize_int4, unpack_int4
    return (x.float() @ dequantize_int4(unpack_int4(qweight), scales_and_zeros, group_size).t()).to(x.dtype)
