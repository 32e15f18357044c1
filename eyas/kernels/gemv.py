"""Triton GEMV / skinny GEMM for batch-1..16 decode: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), M <= 16.

Decode at small batch is bound by reading the weights once per token, so the kernel is built to stream the weight
matrix at full bandwidth; the x rows (M <= 16, a few KB) are re-read from L1/L2 by every program and cost nothing.

Tiling (`_gemv_kernel`). Grid (cdiv(N, BLOCK_N), SPLIT_K). Program (pid_n, pid_k) owns the weight rows
[pid_n * BLOCK_N, +BLOCK_N) and the K range [pid_k * K_PER_SPLIT, +K_PER_SPLIT) (K_PER_SPLIT a multiple of
BLOCK_K). It walks that range in [BLOCK_N, BLOCK_K] weight chunks: each row of a chunk is BLOCK_K contiguous
elements, so a warp issues wide (16-byte per thread) coalesced loads; the x chunk [M_PAD, BLOCK_K] is loaded once
per k-step and used against all BLOCK_N rows. The loop is software-pipelined by Triton (`num_stages`). Products are
accumulated in float32, [BLOCK_N, M_PAD] per program, by one of two constexpr paths:

* elementwise (USE_DOT=False): `sum_k w[n, k] * x[m, k]` as a broadcast multiply [BLOCK_N, M_PAD, BLOCK_K] and a
  `tl.sum` over k, in float32 on the CUDA cores. No tensor cores, exact float32 products; the ALU work grows with
  M, so this is meant for small M.
* tensor cores (USE_DOT=True): `tl.dot(w, x^T)` with x padded to M_PAD = 16 rows (tl.dot's minimum), float32
  accumulation ("ieee" precision for float32 inputs). The padded rows are wasted MMA work, which is free here.
  Under TRITON_INTERPRET a bf16 tl.dot is computed wrongly (numpy has no bf16), so there the tiles are upcast to
  float32 first (UPCAST), as in tree_attention.py.

Split-K. For small N (o_proj and down_proj of an 8B model: N = 4096, so 128 programs of 32 rows) there are too
few programs to keep 132 SMs streaming, so K is split into SPLIT_K ranges: each program then writes its float32
partial sums to a workspace [SPLIT_K, M, N] and `_splitk_reduce_kernel` (grid (M, cdiv(N, 1024))) adds the
partials in a fixed order, adds the bias and casts to the output dtype: deterministic, no atomics. With
SPLIT_K = 1 the main kernel applies the bias and stores the output itself (one launch).

FP8 weights (`scale` given). The weight may be float8_e4m3fn [N, K] with a float32 scale per row (weight-only FP8:
w[n, k] ~= q[n, k] * scale[n], `eyas.layers.linear_fp8`): half the bytes of bf16 to stream. At one or two rows the
default config (`_fp8_config`) takes the elementwise path with float16 products and running sums
(`GemvConfig.half_acc`); from three rows the tensor-core path, the codes widened to float16 after the load (x cast
to float16 to match; both to float32 against float32 x). Each program multiplies its row sums by the row scales
before it stores them (partial sums of a split included: the scale distributes).

Everything is CUDA-graph capturable: the config is a pure function of (M, N, K, dtype) (`default_config`) or given
by the caller, no autotuning, no host synchronisation, and the workspace comes from the caching allocator.

`gemv_reference` is the plain-PyTorch reference: float32 products and accumulation, cast to x.dtype.
Tests: tests/test_gemv.py. Bench (H200): tools/diag/gemv_bench.py. See docs/kernels.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import interpreting

MAX_M = 16
NUM_SMS_H200 = 132
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn
_REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class GemvConfig:
    """Launch configuration of `gemv_triton`.

    BLOCK_N x BLOCK_K is the weight tile a program loads per k-step (keep it <= 8192 elements at 4-8 warps);
    SPLIT_K the number of K ranges (1 = no split, no workspace, one launch); use_dot selects the tensor-core path.
    half_acc (FP8 codes on the elementwise path only): products and each lane's running sum in float16, the codes
    pre-scaled by 2^-8 (|q| / 256 <= 1.75, so a lane's few products stay far below float16's 65504 for any sane x),
    widened to float32 once after the loop: one conversion per two codes instead of three. An experiment (session
    13): less exact than the float32 path (float16 rounding of each product and sum).
    """
    BLOCK_N: int = 32
    BLOCK_K: int = 256
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 4
    use_dot: bool = False
    half_acc: bool = False

    def __post_init__(self):
        for name in ("BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
        if self.SPLIT_K < 1:
            raise ValueError(f"GemvConfig.SPLIT_K must be >= 1, got {self.SPLIT_K}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvConfig.num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.use_dot and (self.BLOCK_N < 16 or self.BLOCK_K < 16):
            raise ValueError("GemvConfig with use_dot needs BLOCK_N >= 16 and BLOCK_K >= 16 (tl.dot minimum)")
        if self.half_acc and self.use_dot:
            raise ValueError("GemvConfig.half_acc is for the elementwise path (use_dot=False)")


def default_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16,
                   num_sms: int = NUM_SMS_H200, weight_dtype: torch.dtype | None = None) -> GemvConfig:
    """Deterministic heuristic (a pure function of its arguments: safe under CUDA graphs).

    * M <= 2: elementwise path, BLOCK_K = 256 (a warp reads 512 contiguous bytes of a row in bf16), BLOCK_N =
      16 / M_PAD (a 4096 / M_PAD element tile), because the deferred float32 accumulator holds
      M_PAD x BLOCK_N x BLOCK_K values (sm_90 ptxas: 80 registers at M = 1, 72 at M = 2, no spills).
      Triton does not pipeline these plain loads (no cp.async), so latency is hidden by occupancy.
    * M >= 3: tensor-core path, BLOCK_N = 64, BLOCK_K = 128 (an 8192-element tile; on sm_90 this is a wgmma
      with x padded to 16 columns, its tiles streamed by cp.async through num_stages = 4 shared-memory buffers,
      80 KB): the CUDA-core work of the elementwise path grows with M and would approach the bandwidth.
    * float32 halves the tile elements (same bytes); tiny N or K shrink the blocks. 4 warps.
    * FP8 weights (`weight_dtype` float8_e4m3fn): `_fp8_config`.
    * Split-K: the smallest power of two giving >= 3 programs per SM (3 * num_sms), while each split keeps
      >= 4 k-steps of K, capped at 16. Llama-3.1-8B, bf16, M = 1: qkv 384 tiles x 2, o 256 x 2, gate_up 1792 x 1,
      down 256 x 2, lm_head 8016 x 1; M = 4: qkv 96 x 8, o 64 x 8, gate_up 448 x 1, down 64 x 8, lm_head 2004 x 1.
    These are guesses from compiling offline for sm_90. The H200 sweep of tools/diag/gemv_bench.py
    (docs/bench/gemv_s3.json) found configs up to ~7% faster, still slower than cuBLAS, so the models use cuBLAS.
    """
    if weight_dtype == FP8:
        return _fp8_config(M, N, K, num_sms)
    use_dot = M > 2
    m_pad = 16 if use_dot else triton.next_power_of_2(M)
    tile = (8192 if use_dot else 4096 // m_pad) // (2 if dtype == torch.float32 else 1)
    block_k = min(128 if use_dot else 256, max(16, triton.next_power_of_2(K)))
    min_n = 16 if use_dot else 1
    block_n = max(min_n, min(tile // block_k, triton.next_power_of_2(N)))
    n_tiles = triton.cdiv(N, block_n)
    split_k = 1
    while (n_tiles * split_k < 3 * num_sms and split_k < 16
           and triton.cdiv(K, split_k * 2) >= 4 * block_k):
        split_k *= 2
    return GemvConfig(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=4,
                      use_dot=use_dot)


def _fp8_config(M: int, N: int, K: int, num_sms: int = NUM_SMS_H200) -> GemvConfig:
    """FP8 codes, from the H200 sweeps of tools/diag/gemv_fp8_bench.py over an 8B draft level's shapes:

    * M <= 2: the elementwise path with float16 products and sums (`half_acc`), 8 x 1024 tiles, no split: the best
      at one row on every shape (docs/bench/fp8_gemv_half_s13.json: a level 141 us, against 163 on the tensor
      cores and 212 for cuBLAS over bf16).
    * 3 <= M <= 16: the tensor-core path (codes widened to float16: one conversion per two codes) in 128 x 128
      tiles, K split into the smallest power of two of ranges giving >= 3/4 of a program per SM (each range >= 4
      k-steps), 8 warps and 3 stages without a split, 4 and 4 with one: the best or near it for all but down_proj
      (32 x 512 tiles, 2 ranges: 24.9 us; docs/bench/fp8_gemv_s13.json).
    The codes stream at only 1.6-3.0 TB/s (cuBLAS streams bf16 at 2.5-4.1), so a level costs ~22-33% less, not half."""
    if M <= 2:
        return GemvConfig(BLOCK_N=8, BLOCK_K=min(1024, max(16, triton.next_power_of_2(K))), SPLIT_K=1,
                          num_warps=4, num_stages=4, half_acc=True)
    block_n = min(128, max(16, triton.next_power_of_2(N)))
    block_k = min(128, max(16, triton.next_power_of_2(K)))
    n_tiles = triton.cdiv(N, block_n)
    split_k = 1
    while (n_tiles * split_k < 3 * num_sms // 4 and split_k < 16
           and triton.cdiv(K, split_k * 2) >= 4 * block_k):
        split_k *= 2
    warps, stages = (8, 3) if split_k == 1 else (4, 4)
    return GemvConfig(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=warps, num_stages=stages,
                      use_dot=True)


# ----------------------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _gemv_kernel(X, W, SCALE, BIAS, OUT, WS, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_om,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr,
                 DOT_PREC: tl.constexpr, HALF_ACC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)      # weight rows = output columns of this program
    offs_m = tl.arange(0, M_PAD)                          # rows of x (M <= M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    # Clamp out-of-range weight rows to row 0 instead of masking them: the loads stay unpredicated (the tail tile
    # reads a few duplicate rows, whose results are never stored). Same for x rows beyond M.
    rows_w = tl.where(n_ok, offs_n, 0).to(tl.int64)
    rows_x = tl.where(m_ok, offs_m, 0)
    w_ptrs = W + rows_w[:, None] * stride_wn + offs_k[None, :]     # [BLOCK_N, BLOCK_K]
    x_ptrs = X + rows_x[:, None] * stride_xm + offs_k[None, :]     # [M_PAD, BLOCK_K]

    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    elif HALF_ACC:
        acc3 = tl.zeros((BLOCK_N, M_PAD, BLOCK_K), dtype=tl.float16)
    else:
        # Elementwise: keep the products of each (n, m, k-lane) apart and reduce over k once after the loop, so
        # the loop body is pure FMAs (a per-step tl.sum costs cross-thread shuffles for every row).
        acc3 = tl.zeros((BLOCK_N, M_PAD, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + offs_k) < k_hi
        w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)   # the weight stream: read once
        x = tl.load(x_ptrs + k0, mask=k_ok[None, :], other=0.0)   # tiny, L1/L2 resident
        if USE_DOT:
            if UPCAST:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            elif HAS_SCALE:  # FP8 codes: one cvt per two codes to float16 (bf16 would take three), x to match
                w = w.to(tl.float16)
                x = x.to(tl.float16)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PREC)      # [BLOCK_N, M_PAD]
        elif HALF_ACC:  # FP8 codes: float16 pairs all along (see GemvConfig.half_acc)
            acc3 += (w.to(tl.float16) * 0.00390625)[:, None, :] * x.to(tl.float16)[None, :, :]
        else:
            acc3 += w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]  # [BLOCK_N, M_PAD, BLOCK_K]
    if HALF_ACC:
        acc = tl.sum(acc3.to(tl.float32), axis=2) * 256.0
    elif not USE_DOT:
        acc = tl.sum(acc3, axis=2)                                            # [BLOCK_N, M_PAD]
    if HAS_SCALE:  # FP8 weights: w = q * scale[n], so each row sum (or a split's part of it) scales as a whole
        acc *= tl.load(SCALE + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]

    # acc[n, m] is out[m, n]: store transposed.
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        # Workspace [SPLIT_K, M, N] float32, contiguous: the reduce kernel adds the bias and casts.
        ws_ptrs = WS + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(ws_ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        out_ptrs = OUT + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(WS, BIAS, OUT, M, N, SPLIT_K, stride_om, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum_s ws[s, m, n] (+ bias[n]), in split order (deterministic). Grid (M, cdiv(N, BLOCK))."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLIT_K):
        acc += tl.load(WS + (s * M + m).to(tl.int64) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + m * stride_om + offs, acc.to(OUT.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------------------------------
# Host wrappers


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           scale: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"gemv_triton expects x [M, K] and weight [N, K], got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}")
    M, K = x.shape
    N, Kw = weight.shape
    if M < 1 or M > MAX_M:
        raise ValueError(f"gemv_triton supports 1 <= M <= {MAX_M} rows of x, got M = {M} (use F.linear)")
    if Kw != K:
        raise ValueError(f"gemv_triton: x has K = {K} but weight [N, K] has K = {Kw}")
    if scale is not None:
        if weight.dtype != FP8 or x.dtype not in _DTYPES:
            raise ValueError(f"gemv_triton with a scale takes float8_e4m3fn weights and float32/float16/bfloat16 x, "
                             f"got weight {weight.dtype} and x {x.dtype}")
        if scale.shape != (N,) or scale.dtype != torch.float32 or scale.stride(0) != 1 or scale.device != x.device:
            raise ValueError(f"gemv_triton: scale must be float32 [N] = [{N}], contiguous, on the device of x; got "
                             f"{scale.dtype} {tuple(scale.shape)}")
    elif x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"gemv_triton supports float32/float16/bfloat16 with x and weight of one dtype (or FP8 "
                         f"weights with a scale), got x {x.dtype} and weight {weight.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"gemv_triton needs x with a contiguous last dimension, got strides {x.stride()}")
    if not weight.is_contiguous():
        raise ValueError(f"gemv_triton needs a contiguous weight [N, K], got strides {weight.stride()}")
    if weight.device != x.device:
        raise ValueError(f"gemv_triton: x on {x.device} but weight on {weight.device}")
    if bias is not None:
        if bias.shape != (N,):
            raise ValueError(f"gemv_triton: bias must be [N] = [{N}], got {tuple(bias.shape)}")
        if bias.stride(0) != 1 or bias.device != x.device:
            raise ValueError("gemv_triton: bias must be contiguous and on the device of x")


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemvConfig | dict | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, contiguous last dim), weight [N, K] contiguous (nn.Linear layout), bias [N] or None ->
    F.linear(x, weight, bias) [M, N] in x.dtype, float32 accumulation. With `scale` (float32 [N]) the weight is
    float8_e4m3fn codes and the product is F.linear(x, weight * scale[:, None], bias). `config` (GemvConfig or a
    dict of its fields) overrides `default_config(M, N, K, dtype)`."""
    _check(x, weight, bias, scale)
    M, K = x.shape
    N = weight.shape[0]
    if config is None:
        cfg = default_config(M, N, K, x.dtype, weight_dtype=weight.dtype)
    elif isinstance(config, dict):
        cfg = GemvConfig(**config)
    else:
        cfg = config
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    if K == 0:
        return out.fill_(0) if bias is None else out.copy_(bias.expand(M, N))

    # Split K into ranges that are whole multiples of BLOCK_K; drop ranges that would be empty.
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.SPLIT_K), cfg.BLOCK_K) * cfg.BLOCK_K
    split_k = triton.cdiv(K, k_per_split)
    m_pad = 16 if cfg.use_dot else triton.next_power_of_2(M)
    # float32 tiles: in the interpreter (no bf16 tl.dot there), and for FP8 codes against float32 x (exact products)
    upcast = cfg.use_dot and ((x.dtype != torch.float32 and interpreting())
                              or (scale is not None and x.dtype == torch.float32))
    dot_prec = "ieee" if (x.dtype == torch.float32 or upcast) else "tf32"  # tf32 is ignored for 16-bit inputs
    has_bias = bias is not None
    ws = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 else out
    grid = (triton.cdiv(N, cfg.BLOCK_N), split_k)
    _gemv_kernel[grid](x, weight, scale if scale is not None else out, bias if has_bias else out, out, ws, M, N, K,
                       k_per_split, x.stride(0), weight.stride(0), out.stride(0),
                       M_PAD=m_pad, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, HAS_SCALE=scale is not None,
                       HAS_BIAS=has_bias,
                       SPLIT=split_k > 1, USE_DOT=cfg.use_dot, UPCAST=upcast, DOT_PREC=dot_prec,
                       HALF_ACC=cfg.half_acc and scale is not None, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages)
    if split_k > 1:
        _splitk_reduce_kernel[(M, triton.cdiv(N, _REDUCE_BLOCK))](
            ws, bias if has_bias else out, out, M, N, split_k, out.stride(0),
            HAS_BIAS=has_bias, BLOCK=_REDUCE_BLOCK, num_warps=4)
    return out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch reference of `gemv_triton`: float32 products and sums, cast to x.dtype (FP8 weights: scaled
    per row first)."""
    w = weight.float() if scale is None else weight.float() * scale.float()[:, None]
    out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
