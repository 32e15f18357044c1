"""Decode linears with their neighbours fused in, launched with programmatic dependent launch (issue #5, point 1).

At batch 1 a decode step is a chain of GEMVs, each bound by streaming its weight, with small kernels between them
(norms, SwiGLU, RoPE and the K/V store, split-K reductions) and a ~1 us gap at every kernel boundary
(docs/benchmarks.md, "Point 1, where the 8B plain step goes": 401 kernels a step; 3.99 ms of GEMMs and their
reductions, 0.58 ms of small kernels, 0.43 ms of gaps). These kernels fold the small kernels into the GEMV around
them, and use Hopper's programmatic dependent launch (PDL) to overlap each kernel's start with the end of the one
before:

* a program owns BLOCK_N whole weight rows and loads all of them (BLOCK_N x K) into registers *first*: the
  weights do not depend on any earlier kernel, so with PDL these loads can be issued before the previous kernel
  has finished (`griddepcontrol.launch_dependents` lets the next grid's programs onto the SMs);
* only then `griddepcontrol.wait` (returns once every earlier grid has finished and its writes are visible), and
  the program reads its rows of x, one at a time against the register tile;
* `decode_linear`: prologue `norm_weight` (x replaced by RMSNorm(x); each program recomputes a row's mean square:
  x is a few KB, read from L2); epilogue `residual` (out = residual + x @ W^T, the residual stream's add) or
  `swiglu` (the weight is a fused [gate; up] projection [2I, K], a program takes gate rows j and up rows I + j
  together and stores silu(gate) * up [I] instead of the 2I outputs);
* `decode_qkv_rope`: a decoder layer's attention input in one launch: RMSNorm, the fused q/k/v projection with
  each program holding the two halves (d, d + D/2) of a head's dimension, RoPE on q and k, and k and v stored
  into the paged cache (or any row store) at each token's slot.

Every rounding follows the unfused path it replaces (`decode_linear_reference`, `decode_qkv_rope_reference`): the
GEMV result is rounded to the model dtype before the residual add, SwiGLU or RoPE, the norm is
`eyas.layers.norm.rms_norm`'s order of operations. Only the GEMV's float32 sum runs in another order than cuBLAS's.

Rows: the register kernel takes up to REGISTER_ROWS (8), each program reading every row of x; at 4 rows the 8B verify
pass of `chain:3` ran at half the speed of cuBLAS plus the fused kernels (session 14), and a version split over K
that reads only its slice of x was as slow (session 26), which points to each row's products and sums against the
tile rather than x's reads. `_tile_linear_kernel` takes 2 to MAX_ROWS (64) rows the tensor-core way (weight tiles
streamed through `tl.dot` against x padded to 16-64 rows, as gemv's USE_DOT path), with the same prologue and
epilogues (`_store_rows`, `_store_pairs`); `_tile_whole_k_kernel` is its variant without a K loop, whose programs load
their whole weight rows before the PDL wait (the default for up to 16 rows of small K: SmolLM2's `chain:3` step 8.5%
shorter, session 37). By default one or two rows take the register kernel, more the tile kernels.
Measured on the H200 (docs/bench/one_row_s14.json, few_rows_s15.json): a synthetic 8B forward's linears with their
small kernels take 3.81-3.84 ms at one row here against 4.25-4.44 for cuBLAS and the fused kernels, and PDL itself
pays little (0.01-0.04 ms a step); at 4 rows the tile kernel loses to cuBLAS on the 8B shapes (4.68 ms at its best
configs against 4.13), and wins on SmolLM2's shapes at 4 and 8 rows (0.63-0.66 against 0.71-0.73), where a step is
bound by launches, not bytes (`eyas.models.one_row.few_rows_pay`).

Without PDL (`pdl=False`, and always under TRITON_INTERPRET) the same kernel runs as an ordinary launch.
Tests: tests/test_decode_linear.py; bench: tools/diag/decode_chain_bench.py; docs/kernels.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from eyas.kernels.interpret import interpreting, pdl_launch
from eyas.layers.linear_fp8 import dequantize_fp8
from eyas.layers.norm import rms_norm


TRIGGERS = ("start", "wait", "end")


@dataclass(frozen=True)
class DecodeLinearConfig:
    """BLOCK_N weight rows per program (for `swiglu`: BLOCK_N / 2 gate rows and their up rows), num_warps;
    `trigger` (with PDL): where a program lets the next kernel's programs launch: "start" (after its weight
    loads are issued), "wait" (after the wait on the previous kernel) or "end" (before its store)."""
    BLOCK_N: int = 4
    num_warps: int = 8
    trigger: str = "end"

    def __post_init__(self):
        if self.BLOCK_N < 1 or self.BLOCK_N & (self.BLOCK_N - 1):
            raise ValueError(f"DecodeLinearConfig.BLOCK_N must be a power of two, got {self.BLOCK_N}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DecodeLinearConfig.num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"DecodeLinearConfig.trigger must be one of {TRIGGERS}, got {self.trigger!r}")


SMALL_WEIGHT = 1 << 22  # elements (8 MB in bf16): SmolLM2's linears are 0.3-1.8M, the 8B shape's 17-59M


# FP8 codes a thread holds (8 warps): the codes become float32 registers before their products, so 128 is the
# limit as for bf16 weights (offline sm_90 compiles: K = 4096 x 8 rows 176 registers, 16 rows spill; 8192 x 4 and
# 14336 x 2 fit, twice that spills). At K = 4096 that is twice the bf16 rule's 64 a thread.
FP8_CODES_PER_THREAD = 128


def default_decode_config(N: int, K: int, swiglu: bool = False, M: int = 1,
                          weight_bytes: int = 2) -> DecodeLinearConfig:
    """From the H200 sweep of tools/diag/decode_chain_bench.py over the 8B shapes (docs/bench/one_row_s14.json):
    4 rows x K = 4096 at 8 warps (SwiGLU: 2 gate/up pairs), 2 rows x K = 14336 at 8 warps, PDL trigger "end".
    A program holds BLOCK_N x next_pow2(K) weights in registers, <= 128 a thread: more spill (offline sm_90
    compiles). Smaller K: up to 16 rows, the same 16k-weight tiles.
    A small weight (< SMALL_WEIGHT elements): 4k-weight tiles at 4 warps (8k for SwiGLU's pairs), from session
    15's sweeps of SmolLM2's shapes (tools/diag/tile_chain_bench.py, docs/bench/few_rows_s15.json): with the best
    per kind of such configs (2-8k weights at 4 warps, which this rule picks or neighbours) a synthetic SmolLM2
    forward of 2 rows took 0.41 ms, against 0.66 on the tile kernel and 0.72 on cuBLAS, and of one row 0.36 against
    0.40 with the 8B rule's 16k tiles: more, smaller programs for a step bound by latency, not bytes. These trigger
    the next launch at "start" (session 39, on the H200: the real SmolLM2's plain decoding 0.412-0.413 ms a step
    against 0.470 with "end", two process pairs); the 8B shape's big grids lost to "start" (session 14).
    `weight_bytes` 1 (FP8 codes): FP8_CODES_PER_THREAD codes a thread at 8 warps (twice the bf16 rule's weights
    at K = 4096, the same above; half at K > 8192 with more than two rows; small weights: 8k-code tiles at 4
    warps)."""
    kp = triton.next_power_of_2(K)
    fp8 = weight_bytes == 1
    if N * (2 if swiglu else 1) * K < SMALL_WEIGHT:
        per = 2 if swiglu else 1  # rows a pair (or a row) takes
        block_n = max(per, min((2 if fp8 else 1) * 4096 * per // kp, per * triton.next_power_of_2(N)))
        return DecodeLinearConfig(BLOCK_N=block_n, num_warps=4, trigger="start")
    if fp8:  # (at 3-8 rows of x beside them, 14336-wide rows of 128 codes a thread spill: half)
        per_thread = FP8_CODES_PER_THREAD if M <= 2 or kp <= 8192 else FP8_CODES_PER_THREAD // 2
        block_n = max(2 if swiglu else 1, min(32, per_thread * 256 // kp))
        return DecodeLinearConfig(BLOCK_N=block_n, num_warps=8 if block_n * kp >= 16384 else 4, trigger="end")
    block_n = max(2 if swiglu else 1, min(16, 16384 // kp) if kp <= 4096 else 32768 // kp)
    elems = block_n * kp
    return DecodeLinearConfig(BLOCK_N=block_n, num_warps=8 if elems >= 16384 else max(1, elems // 2048),
                              trigger="end")


@triton.jit
def _pair_rows(pid, N, P: tl.constexpr, PAIR: tl.constexpr, HD: tl.constexpr):
    """Program `pid`'s P pairs of weight rows: j (the pair, an output column), j_ok (j < N), jj (j, or 0 past N: the
    tail program re-reads pair 0, never stored) and the pair's rows first / second. PAIR 1 (SwiGLU): gate row j and
    up row N + j. PAIR 2 (RoPE): the two halves (f, f + HD) of a head's dimension, f = (j // HD) * 2 HD + j % HD."""
    j = pid * P + tl.arange(0, P)
    j_ok = j < N
    jj = tl.where(j_ok, j, 0)
    if PAIR == 1:
        first = jj
        second = jj + N
    else:
        first = (jj // HD) * (2 * HD) + jj % HD
        second = first + HD
    return j, j_ok, jj, first, second


@triton.jit
def _decode_linear_kernel(X, W, NORM_W, RES, OUT, M, N, K, eps, stride_x, stride_r, stride_o, COS, SIN, POS, DST, KC,
                          VC, stride_cos, Q_ROWS, QK_ROWS, KV_ROW, SEQ_Q, SEQ_ROWS, ROW_OFF, SCALE,
                          KA: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr, M_PAD: tl.constexpr,
                          NORM: tl.constexpr, ADD_RES: tl.constexpr, PAIR: tl.constexpr, HD: tl.constexpr,
                          HAS_DST: tl.constexpr,
                          USE_GDC: tl.constexpr, TRIGGER: tl.constexpr, UNIFORM: tl.constexpr,
                          PRELOAD: tl.constexpr, HAS_SCALE: tl.constexpr):
    """M <= M_PAD rows of x against one weight tile held in registers. PAIR 0: BLOCK_N weight rows n of N.
    PAIR 1 (SwiGLU): BLOCK_N / 2 pairs (gate row j, up row N + j) of N pairs. PAIR 2 (RoPE): pairs (row f, row
    f + HD), f = (j // HD) * 2 HD + j % HD, the two halves of a head's dimension d = j % HD, N pairs; rows below
    Q_ROWS are q (rotated, to OUT), then k (rotated) and v (as they are) to the row stores KC / VC at row DST[m]
    (HAS_DST; skipped when negative) or at a stash's row (`_store_pairs`), KV_ROW elements a row, at position
    POS[m]. HAS_SCALE: W holds FP8 codes (float8_e4m3fn) and SCALE a float32 scale per weight row; each row's sum
    of products with the codes is multiplied by its scale (`eyas.layers.linear_fp8`: w ~= q * scale).
    A row of K is held in two parts whose widths are powers of two, [0, KA) and [KA, KA + KB) (`k_parts`: 576 as
    512 + 64; KB 0 for one part), so that few of the tile's lanes are masked padding."""
    pid = tl.program_id(0)
    offs_k = tl.arange(0, KA)
    k_ok = offs_k < K
    offs_k2 = KA + tl.arange(0, KB if KB > 0 else 1)
    k2_ok = offs_k2 < K
    offs_m = tl.arange(0, M_PAD)
    sc = 1.0
    if PAIR > 0:
        P: tl.constexpr = BLOCK_N // 2
        j, j_ok, jj, first, second = _pair_rows(pid, N, P, PAIR, HD)
        rows = tl.join(first, second).to(tl.int64)                                             # [P, 2]
        w = tl.load(W + rows[:, :, None] * K + offs_k[None, None, :], mask=k_ok[None, None, :], other=0.0)
        if KB > 0:
            w2 = tl.load(W + rows[:, :, None] * K + offs_k2[None, None, :], mask=k2_ok[None, None, :], other=0.0)
        if HAS_SCALE:
            sc = tl.load(SCALE + rows)[:, None, :]                                             # [P, 1, 2]
        acc = tl.zeros((P, M_PAD, 2), dtype=tl.float32)
    else:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        rows = tl.where(n_ok, n, 0).to(tl.int64)  # the tail program re-reads row 0 (never stored): no predicates
        w = tl.load(W + rows[:, None] * K + offs_k[None, :], mask=k_ok[None, :], other=0.0)
        if KB > 0:
            w2 = tl.load(W + rows[:, None] * K + offs_k2[None, :], mask=k2_ok[None, :], other=0.0)
        if HAS_SCALE:
            sc = tl.load(SCALE + rows)[:, None]                                                # [BLOCK_N, 1]
        acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    m_ok = offs_m < M
    tables = 0
    if PAIR == 2 and PRELOAD:  # (step inputs and constant tables: loaded before the wait)
        tables = _rope_tables(jj, offs_m, m_ok, COS, SIN, POS, DST, stride_cos, SEQ_Q, SEQ_ROWS, ROW_OFF, HD, HAS_DST)
    if USE_GDC:
        if TRIGGER == 0:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if TRIGGER == 1:
            tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        g = tl.load(NORM_W + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if KB > 0:
            g2 = tl.load(NORM_W + offs_k2, mask=k2_ok, other=0.0).to(tl.float32)
    wf = w.to(tl.float32)
    if KB > 0:
        wf2 = w2.to(tl.float32)
    # one x row at a time against the register tile; the results gather in acc (no store inside the loop, so the
    # rows' loads need not wait for one another)
    for m in tl.static_range(M_PAD):
        lim = tl.minimum(K, (M - m) * K)                      # K for a row of x, <= 0 for a padding row
        x = tl.load(X + m * stride_x + offs_k, mask=offs_k < lim, other=0.0)
        if KB > 0:
            x2 = tl.load(X + m * stride_x + offs_k2, mask=offs_k2 < lim, other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            ss = tl.sum(xf * xf, axis=0)
            if KB > 0:
                xf2 = x2.to(tl.float32)
                ss += tl.sum(xf2 * xf2, axis=0)
            r = tl.math.rsqrt(ss / K + eps)
            y = (xf * r).to(X.dtype.element_ty)
            x = (g * y.to(tl.float32)).to(X.dtype.element_ty)
            if KB > 0:
                y2 = (xf2 * r).to(X.dtype.element_ty)
                x2 = (g2 * y2.to(tl.float32)).to(X.dtype.element_ty)
        xf = x.to(tl.float32)
        if PAIR > 0:
            part = tl.sum(wf * xf[None, None, :], axis=2)                                     # [P, 2]
            if KB > 0:
                part += tl.sum(wf2 * x2.to(tl.float32)[None, None, :], axis=2)
            acc = tl.where((offs_m == m)[None, :, None], part[:, None, :], acc)
        else:
            part = tl.sum(wf * xf[None, :], axis=1)                                           # [BLOCK_N]
            if KB > 0:
                part += tl.sum(wf2 * x2.to(tl.float32)[None, :], axis=1)
            acc = tl.where((offs_m == m)[None, :], part[:, None], acc)
    if HAS_SCALE:
        acc = acc * sc
    if USE_GDC and TRIGGER == 2:
        tl.extra.cuda.gdc_launch_dependents()
    if PAIR == 2 and not PRELOAD:
        tables = _rope_tables(jj, offs_m, m_ok, COS, SIN, POS, DST, stride_cos, SEQ_Q, SEQ_ROWS, ROW_OFF, HD, HAS_DST)
    if PAIR > 0:
        a, b = tl.split(acc)                                                           # [P, M_PAD] each
        _store_pairs(a, b, j, j_ok, first, offs_m, m_ok, OUT, stride_o, KC, VC, Q_ROWS, QK_ROWS, KV_ROW, tables,
                     PAIR, HD, UNIFORM)
    else:
        _store_rows(acc, n, n_ok, offs_m, m_ok, RES, OUT, stride_r, stride_o, ADD_RES)


@triton.jit
def _store_rows(acc, n, n_ok, offs_m, m_ok, RES, OUT, stride_r, stride_o, ADD_RES: tl.constexpr):
    """The epilogue of plain rows: acc [rows, M_PAD] float32 (weight row n, x row m) rounded to the output dtype,
    plus the residual when ADD_RES, stored to OUT[m, n]."""
    ok = n_ok[:, None] & m_ok[None, :]
    y = acc.to(OUT.dtype.element_ty)
    if ADD_RES:
        r = tl.load(RES + offs_m[None, :] * stride_r + n[:, None], mask=ok, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + offs_m[None, :] * stride_o + n[:, None], y, mask=ok)


@triton.jit
def _rope_tables(jj, offs_m, m_ok, COS, SIN, POS, DST, stride_cos, SEQ_Q, SEQ_ROWS, ROW_OFF, HD: tl.constexpr,
                 HAS_DST: tl.constexpr):
    """What the RoPE epilogue (`_store_pairs`, PAIR 2) reads besides the accumulators: cos/sin of both halves at
    each token's position [P, M_PAD] and each token's destination row [1, M_PAD] (DST[m], or the stash's row).
    None of it is written by the kernels of a step, so the kernels load it before their wait on the previous
    launch (PDL), beside their weights, and its latency no longer trails the GEMV."""
    pos = tl.load(POS + offs_m, mask=m_ok, other=0).to(tl.int64)[None, :]                  # [1, M_PAD]
    d = (jj % HD)[:, None]
    c1 = tl.load(COS + pos * stride_cos + d)
    s1 = tl.load(SIN + pos * stride_cos + d)
    c2 = tl.load(COS + pos * stride_cos + d + HD)
    s2 = tl.load(SIN + pos * stride_cos + d + HD)
    if HAS_DST:
        dst = tl.load(DST + offs_m, mask=m_ok, other=-1).to(tl.int64)[None, :]                # [1, M_PAD]
    else:
        dst = ((offs_m // SEQ_Q) * SEQ_ROWS + ROW_OFF + offs_m % SEQ_Q).to(tl.int64)[None, :]
    return c1, s1, c2, s2, dst


@triton.jit
def _store_pairs(acc_a, acc_b, j, j_ok, first, offs_m, m_ok, OUT, stride_o, KC, VC, Q_ROWS, QK_ROWS, KV_ROW, tables,
                 PAIR: tl.constexpr, HD: tl.constexpr, UNIFORM: tl.constexpr):
    """The epilogue of row pairs: acc_a, acc_b [P, M_PAD] float32, the first and second row of pair j (x row m),
    each rounded to the output dtype as a GEMM output. PAIR 1: silu(a) * b to OUT[m, j]. PAIR 2: RoPE (q and k
    rows; `tables` from `_rope_tables`), q to OUT, k and v to the row stores KC / VC at their destination rows
    (skipped when negative). UNIFORM (the program's rows all in one half of one head: P divides HD): the
    program's rows are all q, all k or all v, so it stores to that one place (two stores, not six masked ones)."""
    a = acc_a.to(OUT.dtype.element_ty).to(tl.float32)
    b = acc_b.to(OUT.dtype.element_ty).to(tl.float32)
    ok = j_ok[:, None] & m_ok[None, :]
    if PAIR == 1:
        s = (a / (1.0 + tl.exp(-a))).to(OUT.dtype.element_ty)              # F.silu in the model dtype
        tl.store(OUT + offs_m[None, :] * stride_o + j[:, None], (s.to(tl.float32) * b).to(OUT.dtype.element_ty),
                 mask=ok)
    else:
        c1, s1, c2, s2, dst = tables
        f = first[:, None]
        q_at = OUT + offs_m[None, :] * stride_o + f
        if UNIFORM:
            f0 = tl.min(first, axis=0)
            if f0 < QK_ROWS:                                                   # q and k rows: RoPE
                a2 = (a * c1 - b * s1).to(OUT.dtype.element_ty)                # x * cos + rotate_half(x) * sin
                b2 = (b * c2 + a * s2).to(OUT.dtype.element_ty)
                if f0 < Q_ROWS:
                    tl.store(q_at, a2, mask=ok)
                    tl.store(q_at + HD, b2, mask=ok)
                else:
                    kr = dst * KV_ROW + (f - Q_ROWS)
                    tl.store(KC + kr, a2.to(KC.dtype.element_ty), mask=ok & (dst >= 0))
                    tl.store(KC + kr + HD, b2.to(KC.dtype.element_ty), mask=ok & (dst >= 0))
            else:
                vr = dst * KV_ROW + (f - QK_ROWS)
                tl.store(VC + vr, a.to(OUT.dtype.element_ty).to(VC.dtype.element_ty), mask=ok & (dst >= 0))
                tl.store(VC + vr + HD, b.to(OUT.dtype.element_ty).to(VC.dtype.element_ty), mask=ok & (dst >= 0))
        else:
            rot = f < QK_ROWS                                                  # q and k rows: RoPE
            a2 = tl.where(rot, a * c1 - b * s1, a).to(OUT.dtype.element_ty)    # x * cos + rotate_half(x) * sin
            b2 = tl.where(rot, b * c2 + a * s2, b).to(OUT.dtype.element_ty)
            is_q = ok & (f < Q_ROWS)
            tl.store(q_at, a2, mask=is_q)
            tl.store(q_at + HD, b2, mask=is_q)
            is_k = ok & rot & (f >= Q_ROWS) & (dst >= 0)
            is_v = ok & (f >= QK_ROWS) & (dst >= 0)
            kr = dst * KV_ROW + tl.where(is_k, f - Q_ROWS, 0)
            vr = dst * KV_ROW + tl.where(is_v, f - QK_ROWS, 0)
            tl.store(KC + kr, a2.to(KC.dtype.element_ty), mask=is_k)
            tl.store(KC + kr + HD, b2.to(KC.dtype.element_ty), mask=is_k)
            tl.store(VC + vr, a2.to(VC.dtype.element_ty), mask=is_v)
            tl.store(VC + vr + HD, b2.to(VC.dtype.element_ty), mask=is_v)


@triton.jit
def _tile_linear_kernel(X, W, NORM_W, RES, OUT, M, N, K, eps, stride_x, stride_r, stride_o, COS, SIN, POS, DST, KC,
                        VC, stride_cos, Q_ROWS, QK_ROWS, KV_ROW, SEQ_Q, SEQ_ROWS, ROW_OFF, KP: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, NORM: tl.constexpr,
                        ADD_RES: tl.constexpr, PAIR: tl.constexpr, HD: tl.constexpr, HAS_DST: tl.constexpr,
                        USE_GDC: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, UNIFORM: tl.constexpr,
                        PRELOAD: tl.constexpr, FIRST_W: tl.constexpr, EARLY: tl.constexpr = False):
    """Several rows of x (M <= M_PAD, M_PAD >= 16) against BLOCK_N weight rows streamed in [rows, BLOCK_K] tiles
    through the tensor cores (acc[rows, M_PAD] += w @ x^T, as gemv's USE_DOT path): each program reads its weight
    rows once and all of x once (from L2), whatever M. Rows and pairs (PAIR, HD, the stores) as
    `_decode_linear_kernel`. NORM: a first pass over x gives each row's mean square (unrolled over KP =
    next_pow2(K), so that its loads can be in flight together; as a loop the 8B forward of 4 rows took 7.19 ms,
    unrolled 6.46), the second applies the norm tile by tile with rms_norm's roundings. FIRST_W
    (`TileConfig.first_w`): the first K tile's weights are loaded before the PDL wait (the whole-K tile's gain for
    rows too wide to hold whole), and the loop's first step takes them instead of loading."""
    pid = tl.program_id(0)
    offs_m = tl.program_id(1) * M_PAD + tl.arange(0, M_PAD)         # this program's block of x rows (BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + tl.where(m_ok, offs_m, 0)[:, None] * stride_x + offs_k[None, :]   # padding rows re-read row 0
    if PAIR > 0:
        P: tl.constexpr = BLOCK_N // 2
        j, j_ok, jj, first, second = _pair_rows(pid, N, P, PAIR, HD)
        wa_ptrs = W + first.to(tl.int64)[:, None] * K + offs_k[None, :]
        wb_ptrs = W + second.to(tl.int64)[:, None] * K + offs_k[None, :]
        acc_a = tl.zeros((P, M_PAD), dtype=tl.float32)
        acc_b = tl.zeros((P, M_PAD), dtype=tl.float32)
    else:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        wa_ptrs = W + tl.where(n_ok, n, 0).to(tl.int64)[:, None] * K + offs_k[None, :]
        acc_a = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
        j, j_ok, jj, first, acc_b = n, n_ok, n, n, acc_a            # (`_tile_end`'s names; acc_b unused)
    tables = 0
    if PAIR == 2 and PRELOAD:  # (step inputs and constant tables: loaded before the wait)
        tables = _rope_tables(jj, offs_m, m_ok, COS, SIN, POS, DST, stride_cos, SEQ_Q, SEQ_ROWS, ROW_OFF, HD, HAS_DST)
    wa0 = 0
    wb0 = 0
    if FIRST_W:
        wa0 = tl.load(wa_ptrs, mask=(offs_k < K)[None, :], other=0.0)
        if PAIR > 0:
            wb0 = tl.load(wb_ptrs, mask=(offs_k < K)[None, :], other=0.0)
    if USE_GDC:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if NORM:
        ss = tl.zeros((M_PAD,), dtype=tl.float32)
        for k0 in tl.static_range(0, KP, BLOCK_K):
            xs = tl.load(x_ptrs + k0, mask=(offs_k < K - k0)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(xs * xs, axis=1)
        rstd = tl.math.rsqrt(ss / K + eps)[:, None]
    for k0 in range(0, K, BLOCK_K):
        k_ok = (offs_k < K - k0)[None, :]
        x = tl.load(x_ptrs + k0, mask=k_ok, other=0.0)
        if NORM:
            x = _norm_tile(x, rstd, NORM_W, k0 + offs_k, offs_k < K - k0)
        if UPCAST:  # the Triton interpreter's bf16 tl.dot is wrong: do its dots in float32 (exact products)
            x = x.to(tl.float32)
        if FIRST_W:  # the first step's tile is loaded already: no load there, its registers taken instead
            wa = tl.where(k0 == 0, wa0, tl.load(wa_ptrs + k0, mask=k_ok & (k0 > 0), other=0.0))
        else:
            wa = tl.load(wa_ptrs + k0, mask=k_ok, other=0.0)
        if UPCAST:
            wa = wa.to(tl.float32)
        acc_a = tl.dot(wa, tl.trans(x), acc_a, input_precision=DOT_PREC)
        if PAIR > 0:
            if FIRST_W:
                wb = tl.where(k0 == 0, wb0, tl.load(wb_ptrs + k0, mask=k_ok & (k0 > 0), other=0.0))
            else:
                wb = tl.load(wb_ptrs + k0, mask=k_ok, other=0.0)
            if UPCAST:
                wb = wb.to(tl.float32)
            acc_b = tl.dot(wb, tl.trans(x), acc_b, input_precision=DOT_PREC)
    _tile_end(acc_a, acc_b, j, j_ok, jj, first, offs_m, m_ok, RES, OUT, stride_r, stride_o, COS, SIN, POS, DST, KC, VC,
              stride_cos, Q_ROWS, QK_ROWS, KV_ROW, SEQ_Q, SEQ_ROWS, ROW_OFF, tables, ADD_RES, PAIR, HD, HAS_DST,
              USE_GDC and not EARLY, UNIFORM, PRELOAD)


@triton.jit
def _norm_tile(x, rstd, NORM_W, offs, ok):
    """The tile kernels' input norm of x [rows, k] (the model dtype) with each row's rstd [rows, 1]: x * rstd
    rounded to the dtype, then times the norm weight at columns `offs` (`ok`: inside K), rounded again
    (`eyas.layers.norm.rms_norm`'s roundings)."""
    g = tl.load(NORM_W + offs, mask=ok, other=0.0).to(tl.float32)
    y = (x.to(tl.float32) * rstd).to(x.dtype)
    return (g[None, :] * y.to(tl.float32)).to(x.dtype)


@triton.jit
def _tile_end(acc_a, acc_b, j, j_ok, jj, first, offs_m, m_ok, RES, OUT, stride_r, stride_o, COS, SIN, POS, DST, KC, VC,
              stride_cos, Q_ROWS, QK_ROWS, KV_ROW, SEQ_Q, SEQ_ROWS, ROW_OFF, tables, ADD_RES: tl.constexpr,
              PAIR: tl.constexpr, HD: tl.constexpr, HAS_DST: tl.constexpr, USE_GDC: tl.constexpr,
              UNIFORM: tl.constexpr, PRELOAD: tl.constexpr):
    """The tile kernels' end: let the next launch in (PDL), then the epilogue's stores. Pairs: `_store_pairs` of
    pair j (`_pair_rows`' j, j_ok, jj, first); rows: `_store_rows` of weight rows j (j_ok; jj and first unused)."""
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if PAIR == 2 and not PRELOAD:
        tables = _rope_tables(jj, offs_m, m_ok, COS, SIN, POS, DST, stride_cos, SEQ_Q, SEQ_ROWS, ROW_OFF, HD, HAS_DST)
    if PAIR > 0:
        _store_pairs(acc_a, acc_b, j, j_ok, first, offs_m, m_ok, OUT, stride_o, KC, VC, Q_ROWS, QK_ROWS, KV_ROW, tables,
                     PAIR, HD, UNIFORM)
    else:
        _store_rows(acc_a, j, j_ok, offs_m, m_ok, RES, OUT, stride_r, stride_o, ADD_RES)


@triton.jit
def _whole_k_dot(acc, w1, w2, x1, x2, KB: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    if UPCAST:  # the Triton interpreter's bf16 tl.dot is wrong: do its dots in float32 (exact products)
        w1 = w1.to(tl.float32)
        x1 = x1.to(tl.float32)
    acc = tl.dot(w1, tl.trans(x1), acc, input_precision=DOT_PREC)
    if KB > 0:
        if UPCAST:
            w2 = w2.to(tl.float32)
            x2 = x2.to(tl.float32)
        acc = tl.dot(w2, tl.trans(x2), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _tile_whole_k_kernel(X, W, NORM_W, RES, OUT, M, N, K, eps, stride_x, stride_r, stride_o, COS, SIN, POS, DST, KC,
                         VC, stride_cos, Q_ROWS, QK_ROWS, KV_ROW, SEQ_Q, SEQ_ROWS, ROW_OFF, KA: tl.constexpr,
                         KB: tl.constexpr, BLOCK_N: tl.constexpr, M_PAD: tl.constexpr, NORM: tl.constexpr,
                         ADD_RES: tl.constexpr, PAIR: tl.constexpr, HD: tl.constexpr, HAS_DST: tl.constexpr,
                         USE_GDC: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, UNIFORM: tl.constexpr,
                         PRELOAD: tl.constexpr, JOINED: tl.constexpr, EARLY: tl.constexpr = False):
    """The tile kernel without a K loop (`TileConfig.BLOCK_K = 0`): a program loads its whole weight rows, as two
    parts of KA and KB columns (`_tile_k_parts`), *before* its wait on the previous launch (as the register kernel
    does: with PDL their latency overlaps the previous kernel's end), then its rows of x once, the norm's sums of
    squares from those same loads, and one or two tl.dot per accumulator. Prologue, pairs and epilogues as
    `_tile_linear_kernel`'s. JOINED (pairs): the P pairs' 2P rows are loaded as one interleaved tile (first, second,
    first, ...) against one accumulator, split into the two halves after the dot; else two tiles, two
    accumulators."""
    pid = tl.program_id(0)
    offs_m = tl.program_id(1) * M_PAD + tl.arange(0, M_PAD)
    m_ok = offs_m < M
    xrow = tl.where(m_ok, offs_m, 0)[:, None] * stride_x                    # padding rows re-read row 0
    ka = tl.arange(0, KA)
    ka_ok = ka < K
    kb = KA + tl.arange(0, KB if KB > 0 else 16)
    kb_ok = kb < K
    wb1 = 0
    wb2 = 0
    wa2 = 0
    if PAIR > 0 and JOINED:
        P: tl.constexpr = BLOCK_N // 2
        j, j_ok, jj, first, second = _pair_rows(pid, N, P, PAIR, HD)
        ra = tl.reshape(tl.join(first, second), (BLOCK_N,)).to(tl.int64)[:, None] * K
        wa1 = tl.load(W + ra + ka[None, :], mask=ka_ok[None, :], other=0.0)
        if KB > 0:
            wa2 = tl.load(W + ra + kb[None, :], mask=kb_ok[None, :], other=0.0)
        acc_a = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    elif PAIR > 0:
        P: tl.constexpr = BLOCK_N // 2
        j, j_ok, jj, first, second = _pair_rows(pid, N, P, PAIR, HD)
        ra = first.to(tl.int64)[:, None] * K
        rb = second.to(tl.int64)[:, None] * K
        wa1 = tl.load(W + ra + ka[None, :], mask=ka_ok[None, :], other=0.0)
        wb1 = tl.load(W + rb + ka[None, :], mask=ka_ok[None, :], other=0.0)
        if KB > 0:
            wa2 = tl.load(W + ra + kb[None, :], mask=kb_ok[None, :], other=0.0)
            wb2 = tl.load(W + rb + kb[None, :], mask=kb_ok[None, :], other=0.0)
        acc_a = tl.zeros((P, M_PAD), dtype=tl.float32)
        acc_b = tl.zeros((P, M_PAD), dtype=tl.float32)
    else:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        ra = tl.where(n_ok, n, 0).to(tl.int64)[:, None] * K
        wa1 = tl.load(W + ra + ka[None, :], mask=ka_ok[None, :], other=0.0)
        if KB > 0:
            wa2 = tl.load(W + ra + kb[None, :], mask=kb_ok[None, :], other=0.0)
        acc_a = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
        j, j_ok, jj, first, acc_b = n, n_ok, n, n, acc_a            # (`_tile_end`'s names; acc_b unused)
    tables = 0
    if PAIR == 2 and PRELOAD:
        tables = _rope_tables(jj, offs_m, m_ok, COS, SIN, POS, DST, stride_cos, SEQ_Q, SEQ_ROWS, ROW_OFF, HD, HAS_DST)
    if USE_GDC:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x1 = tl.load(X + xrow + ka[None, :], mask=ka_ok[None, :], other=0.0)
    x2 = 0
    if KB > 0:
        x2 = tl.load(X + xrow + kb[None, :], mask=kb_ok[None, :], other=0.0)
    if NORM:
        xf1 = x1.to(tl.float32)
        ss = tl.sum(xf1 * xf1, axis=1)
        if KB > 0:
            xf2 = x2.to(tl.float32)
            ss += tl.sum(xf2 * xf2, axis=1)
        rstd = tl.math.rsqrt(ss / K + eps)[:, None]
        x1 = _norm_tile(x1, rstd, NORM_W, ka, ka_ok)
        if KB > 0:
            x2 = _norm_tile(x2, rstd, NORM_W, kb, kb_ok)
    acc_a = _whole_k_dot(acc_a, wa1, wa2, x1, x2, KB, UPCAST, DOT_PREC)
    if PAIR > 0 and JOINED:
        acc_a, acc_b = tl.split(tl.permute(tl.reshape(acc_a, (P, 2, M_PAD)), (0, 2, 1)))
    elif PAIR > 0:
        acc_b = _whole_k_dot(acc_b, wb1, wb2, x1, x2, KB, UPCAST, DOT_PREC)
    _tile_end(acc_a, acc_b, j, j_ok, jj, first, offs_m, m_ok, RES, OUT, stride_r, stride_o, COS, SIN, POS, DST, KC, VC,
              stride_cos, Q_ROWS, QK_ROWS, KV_ROW, SEQ_Q, SEQ_ROWS, ROW_OFF, tables, ADD_RES, PAIR, HD, HAS_DST,
              USE_GDC and not EARLY, UNIFORM, PRELOAD)


def _tile_k_parts(K: int) -> tuple[int, int]:
    """The whole-K tile's row parts: `k_parts`, each at least 16 wide (tl.dot's least K)."""
    ka, kb = k_parts(K)
    ka = max(16, ka)
    return ka, (max(16, kb) if kb and ka < K else 0)


# RoPE launches whose programs' rows lie in one half of one head store to one place (`_store_pairs`' UNIFORM);
# False: every program takes the masked stores to q, k and v. PRELOAD_ROPE: the RoPE epilogue's positions, cos/sin
# and destination rows are loaded before the kernel's wait on the previous launch (`_rope_tables`); False: after
# the GEMV, as before session 18. Both switches are for comparing the two.
UNIFORM_PAIRS = True
PRELOAD_ROPE = True

# `default_tile_config` gives launches of at most WHOLE_K_ROWS rows whose K fits WHOLE_K_MAX_K (the two parts'
# widths; twice that above 16 rows) the whole-K tile (BLOCK_K = 0); 0: never. 64 since session 38 (16 in session 37),
# with one_row.FEW_ROWS_MAX = 64: SmolLM2's default tree's 49-row verify pass on these tiles took its step from
# 1.159 to 1.109 ms on the real model (docs/benchmarks.md, "Session 38").
WHOLE_K_ROWS = 64
WHOLE_K_MAX_K = 1024
JOINED_PAIRS = True  # the whole-K tile loads a program's pairs as one interleaved tile (False: two tiles)
# The whole-K tile may stage its weight rows and its block of x in shared memory at once, (BLOCK_N + BLOCK_M) x the K
# parts' width elements (`whole_k_shared_bytes`, a bound: float32's dot comes close, down at 49 rows asked 294,912
# bytes on the H200 in session 38's graph test; bf16's asks far less, 32 KB offline). sm_90 gives a block at most
# 227 KB; `default_tile_config` takes the K loop where the bound does not fit.
WHOLE_K_SHARED = 232448
# Where a tile kernel lets the next PDL launch in: True (since session 39), as soon as its weight loads are issued,
# before its own wait, so that the next kernel's programs load their weights while this one computes (SmolLM2's tile
# grids have 30-120 programs, fewer than the H200's 132 SMs); False: just before its stores (`_tile_end`). On the H200,
# the real SmolLM2's default tree took 1.082-1.093 ms a step against 1.112-1.123 (two process pairs, both orders;
# docs/benchmarks.md, "Session 39"; on random weights, smollm2-shape, no change).
TILE_EARLY_TRIGGER = True
MAX_ROWS = 64        # the tile kernel's limit (x padded to a power of two >= 16 rows)
EXACT_K = True  # the register kernel holds K as two power-of-two parts (`k_parts`); False: one padded part


def k_parts(K: int) -> tuple[int, int]:
    """The register kernel's row widths (KA, KB): with EXACT_K, KA the largest power of two <= K and KB the next
    power of two >= the rest, where the two hold fewer lanes than one padded part: 576 -> (512, 64),
    1536 -> (1024, 512); else (next_pow2(K), 0): 4096 -> (4096, 0), 14336 -> (16384, 0) (8192 + 8192 would be no
    fewer)."""
    kp = triton.next_power_of_2(K)
    if not EXACT_K or K == kp:
        return kp, 0
    ka = kp // 2
    kb = triton.next_power_of_2(K - ka)
    return (ka, kb) if ka + kb < kp else (kp, 0)


REGISTER_ROWS = 8    # the register kernel's limit (it re-reads x per program: meant for one row)


@dataclass(frozen=True)
class TileConfig:
    """The tile kernel (`_tile_linear_kernel`, 2 to MAX_ROWS rows): BLOCK_N weight rows per program (for pairs,
    BLOCK_N / 2 of each half; tl.dot wants >= 16 a half), streamed in BLOCK_K-wide tiles through num_stages
    shared-memory buffers. BLOCK_K = 0: the whole-K tile (`_tile_whole_k_kernel`: the whole rows loaded before the
    PDL wait, no K loop; num_stages unused). BLOCK_M: x's rows a program takes (0: all)."""
    BLOCK_N: int = 32
    BLOCK_K: int = 256
    num_warps: int = 4
    num_stages: int = 4
    BLOCK_M: int = 0     # x rows per program: 0 = all of them (padded to a power of two >= 16); else a power of
    #                      two >= 16, and a second grid dimension over the blocks of rows
    first_w: bool = False  # the K loop's first weight tile loaded before the PDL wait (BLOCK_K > 0 only)

    def __post_init__(self):
        for name in ("BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if name == "BLOCK_K" and v == 0:  # the whole row of K at once, the weights loaded before the wait
                continue
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {v}")
        if self.BLOCK_M and (self.BLOCK_M < 16 or self.BLOCK_M & (self.BLOCK_M - 1)):
            raise ValueError(f"TileConfig.BLOCK_M must be 0 or a power of two >= 16, got {self.BLOCK_M}")
        if self.first_w and self.BLOCK_K == 0:
            raise ValueError("TileConfig.first_w is for the K loop (BLOCK_K > 0); the whole-K tile loads all of its "
                             "weights before the wait already")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"TileConfig.num_stages must be >= 1, got {self.num_stages}")


def whole_k_shared_bytes(cfg: TileConfig, M: int, K: int, elem_bytes: int) -> int:
    """The shared memory a whole-K tile (BLOCK_K = 0) asks for: its weight rows and its block of x, K wide."""
    return (cfg.BLOCK_N + (cfg.BLOCK_M or max(16, triton.next_power_of_2(M)))) * sum(_tile_k_parts(K)) * elem_bytes


def default_tile_config(M: int, N: int, K: int, pairs: bool = False, elem_bytes: int = 2) -> TileConfig:
    """16 weight rows per accumulator (32 for pairs: 16 of each half), so that even N = 4096 gives 256 programs;
    tiles 256 wide at 16 padded rows, 128 at 32, 64 at 64 (the x tile and its pointers live in registers: sm_90
    offline compiles spill from 64 x 128 at 4 warps), 4 stages (3 at 64 rows), 4 warps. A first guess;
    tools/diag/tile_chain_bench.py sweeps it. Up to WHOLE_K_ROWS rows and K parts up to WHOLE_K_MAX_K wide: the
    whole-K tile, which beat these loop tiles at 8 and 16 rows on SmolLM2's shapes (docs/kernels.md, session 37);
    above 16 rows, session 37's 49-row sweep's best per kind (session 38: the fastest there for every kind). The
    whole-K tile only where its shared memory fits (`whole_k_shared_bytes` of `elem_bytes` elements:
    WHOLE_K_SHARED)."""
    whole = None
    if M <= WHOLE_K_ROWS:
        width = sum(_tile_k_parts(K))
        if M <= 16 and width <= WHOLE_K_MAX_K:
            whole = TileConfig(BLOCK_N=32 if pairs else 16, BLOCK_K=0, num_warps=4, num_stages=1, BLOCK_M=16)
        elif M > 16 and width <= 2 * WHOLE_K_MAX_K:  # (the 49-row sweeps of sessions 37 and 38)
            if pairs:  # many pairs (SwiGLU's 1536): 64-row tiles; few (RoPE's 480): smaller ones, more programs
                whole = TileConfig(BLOCK_N=64, BLOCK_K=0, num_warps=4, num_stages=1, BLOCK_M=32) if N >= 1024 else \
                    TileConfig(BLOCK_N=32, BLOCK_K=0, num_warps=4, num_stages=1, BLOCK_M=16)
            else:
                whole = TileConfig(BLOCK_N=16, BLOCK_K=0, num_warps=4, num_stages=1, BLOCK_M=32)
    if whole is not None and whole_k_shared_bytes(whole, M, K, elem_bytes) <= WHOLE_K_SHARED:
        return whole
    m_pad = max(16, triton.next_power_of_2(M))
    block_k = min(4096 // m_pad, max(16, triton.next_power_of_2(K)))
    return TileConfig(BLOCK_N=32 if pairs else 16, BLOCK_K=block_k, num_warps=4, num_stages=4 if m_pad <= 32 else 3)


def default_config(M: int, N: int, K: int, pairs: bool = False,
                   elem_bytes: int = 2) -> DecodeLinearConfig | TileConfig:
    """The default for M rows, N outputs (pairs for SwiGLU / RoPE) over K: the register kernel for one or two rows
    (at two rows it reads x twice per program, still cheaper than the tile kernel's pipeline on SmolLM2's shapes),
    the tile kernel for more (`elem_bytes`: the weights' element size)."""
    return default_decode_config(N, K, pairs, M) if M <= 2 else default_tile_config(M, N, K, pairs, elem_bytes)


def _config(cfg, M: int, n_out: int, K: int, pairs: bool, fp8: bool = False, elem_bytes: int = 2):
    """The given config (checked), or `default_config` (for FP8 weights: the register kernel's, at up to
    REGISTER_ROWS rows)."""
    if cfg is None:
        cfg = default_decode_config(n_out, K, pairs, M, weight_bytes=1) if fp8 and M <= REGISTER_ROWS else \
            default_config(M, n_out, K, pairs, elem_bytes)
    if fp8 and not isinstance(cfg, DecodeLinearConfig):
        raise ValueError(f"FP8 weights (scale=) take the register kernel (DecodeLinearConfig) at 1 to "
                         f"{REGISTER_ROWS} rows, got {M} rows and {type(cfg).__name__}")
    if isinstance(cfg, DecodeLinearConfig):
        if M > REGISTER_ROWS:
            raise ValueError(f"the register kernel (DecodeLinearConfig) takes 1 to {REGISTER_ROWS} rows, got {M}")
        if pairs and cfg.BLOCK_N < 2:
            raise ValueError("decode_linear(swiglu=True) and decode_qkv_rope need BLOCK_N >= 2")
    elif not isinstance(cfg, TileConfig):
        raise TypeError(f"config must be a DecodeLinearConfig or a TileConfig, got {type(cfg).__name__}")
    return cfg


def _rows(x: torch.Tensor, what: str) -> tuple[torch.Tensor, int, int]:
    """x [..., K] -> (a [M, K] view with a contiguous last dimension, M, K); 1 <= M <= MAX_ROWS."""
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"{what} takes 1 to {MAX_ROWS} rows, got x {tuple(x.shape)}")
    x2 = x.reshape(M, K)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), M, K


def _check_weight(weight: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor, what: str) -> None:
    """The weight has x's dtype (no scale), or holds FP8 codes (float8_e4m3fn) with `scale` a contiguous float32
    value per weight row; on x's device."""
    if scale is None:
        if weight.dtype != x.dtype or weight.device != x.device:
            raise ValueError(f"{what}: weight {weight.dtype} on {weight.device}, x {x.dtype} on {x.device}")
        return
    if weight.dtype != torch.float8_e4m3fn or weight.device != x.device:
        raise ValueError(f"{what} with scale= takes float8_e4m3fn codes on x's device, got {weight.dtype} on "
                         f"{weight.device}")
    if scale.shape != (weight.shape[0],) or scale.dtype != torch.float32 or not scale.is_contiguous() \
            or scale.device != x.device:
        raise ValueError(f"{what}: scale must be {weight.shape[0]} contiguous float32 values (one a weight row) on "
                         f"x's device, got {tuple(scale.shape)} {scale.dtype}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + (sum((n - 1) * st for n, st in zip(a.shape, a.stride())) + 1) * a.element_size()
    b1 = b0 + (sum((n - 1) * st for n, st in zip(b.shape, b.stride())) + 1) * b.element_size()
    return a0 < b1 and b0 < a1


def _launch(x2, M, K, weight, cfg, pdl, n_out, out2, *, norm_weight=None, eps=1e-5, res2=None, pair=0, hd=1,
            rope=None, stash=None, scale=None):
    """`n_out` outputs (pairs for `pair`); `rope` the RoPE/store arguments; `stash` (seq_q, seq_rows, row_offset)
    the computed destination rows when rope's destination tensor is None; `scale` FP8 codes' row scales (the
    register kernel only)."""
    use_gdc, kwargs = pdl_launch(pdl)
    cos, sin, pos, dst, kc, vc, stride_cos, q_rows, qk_rows, kv_row = rope or (out2,) * 6 + (0,) * 4
    N = weight.shape[0] // 2 if pair else weight.shape[0]
    common = (x2, weight, norm_weight if norm_weight is not None else x2, res2 if res2 is not None else out2, out2, M,
              N, K, eps, x2.stride(0), res2.stride(0) if res2 is not None else 0, out2.stride(0), cos, sin, pos,
              dst if dst is not None else pos, kc, vc, stride_cos, q_rows, qk_rows, kv_row)
    seq_q, seq_rows, row_offset = stash or (1, 0, 0)
    consts = _epilogue_constexprs(cfg, pair, hd, norm=norm_weight is not None, res=res2 is not None,
                                  has_dst=dst is not None, use_gdc=use_gdc)
    per_prog = cfg.BLOCK_N // 2 if pair else cfg.BLOCK_N
    if isinstance(cfg, DecodeLinearConfig):
        _decode_linear_kernel[(triton.cdiv(n_out, per_prog),)](
            *common, seq_q, seq_rows, row_offset, scale if scale is not None else x2, num_warps=cfg.num_warps,
            enable_fp_fusion=False, **_register_constexprs(cfg, M, K, consts, scale is not None), **kwargs)
        return
    kernel, consts, options = _tile_launch(cfg, M, K, x2.dtype, consts)
    grid = (triton.cdiv(n_out, per_prog), triton.cdiv(M, consts["M_PAD"]))
    kernel[grid](*common, seq_q, seq_rows, row_offset, enable_fp_fusion=False, **consts, **options, **kwargs)


def _epilogue_constexprs(cfg, pair: int, hd: int, *, norm: bool, res: bool, has_dst: bool, use_gdc: bool) -> dict:
    """The constexprs every decode_linear kernel takes alike: prologue, epilogue, PDL. UNIFORM: a program's RoPE
    rows lie in one half of one head (`_store_pairs`)."""
    per_prog = cfg.BLOCK_N // 2 if pair else cfg.BLOCK_N
    return dict(NORM=norm, ADD_RES=res, PAIR=pair, HD=hd, HAS_DST=has_dst, USE_GDC=use_gdc,
                UNIFORM=UNIFORM_PAIRS and pair == 2 and hd % per_prog == 0, PRELOAD=PRELOAD_ROPE)


def _register_constexprs(cfg: DecodeLinearConfig, M: int, K: int, consts: dict, has_scale: bool) -> dict:
    """The register kernel's constexprs (`consts`, `_epilogue_constexprs`', and its own) for M rows of K. Also what
    the tests compile offline for sm_90."""
    ka, kb = k_parts(K)
    return dict(consts, KA=ka, KB=kb, BLOCK_N=cfg.BLOCK_N, M_PAD=triton.next_power_of_2(M),
                TRIGGER=TRIGGERS.index(cfg.trigger), HAS_SCALE=has_scale)


def _tile_launch(cfg: TileConfig, M: int, K: int, dtype: torch.dtype, consts: dict):
    """The tile kernel a TileConfig takes (the whole-K tile for BLOCK_K = 0, else the K loop), its constexprs
    (`consts`, `_epilogue_constexprs`', and the tile's own) and launch options. Also what tools/diag/tile_regs.py
    compiles."""
    upcast = dtype != torch.float32 and interpreting()
    tile = dict(consts, BLOCK_N=cfg.BLOCK_N, M_PAD=cfg.BLOCK_M or max(16, triton.next_power_of_2(M)), UPCAST=upcast,
                EARLY=bool(TILE_EARLY_TRIGGER and consts["USE_GDC"]),
                DOT_PREC="ieee" if (dtype == torch.float32 or upcast) else "tf32")
    if cfg.BLOCK_K == 0:
        ka, kb = _tile_k_parts(K)
        return (_tile_whole_k_kernel, dict(tile, KA=ka, KB=kb, JOINED=JOINED_PAIRS),
                dict(num_warps=cfg.num_warps, num_stages=1))
    return (_tile_linear_kernel,
            dict(tile, KP=triton.next_power_of_2(K), BLOCK_K=cfg.BLOCK_K, FIRST_W=bool(cfg.first_w)),
            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def decode_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-5, residual: torch.Tensor | None = None, swiglu: bool = False,
                  out: torch.Tensor | None = None, pdl: bool = False,
                  config: DecodeLinearConfig | TileConfig | None = None,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (1 to MAX_ROWS rows), weight [N, K] contiguous, no bias -> [..., N] (or N / 2 with `swiglu`) in
    x.dtype, row by row:

        h = rms_norm(x, norm_weight, eps) if norm_weight is given else x
        y = F.linear(h, weight)                              (rounded to x.dtype)
        y = silu(y[:N/2]) * y[N/2:]  if swiglu               (weight = a fused [gate; up] projection)
        y = residual + y             if residual is given    (residual [..., N]; `out` may be the residual itself)

    `pdl`: launch with programmatic dependent launch (CUDA, sm_90+; ignored under TRITON_INTERPRET). `config`:
    the register kernel (DecodeLinearConfig; the default for one row) or the tile kernel (TileConfig; the default
    for more). `scale`: the weight is FP8 codes (float8_e4m3fn) with this float32 scale per row
    (`eyas.layers.linear_fp8`: F.linear(h, codes * scale[:, None])), on the register kernel only (1 to
    REGISTER_ROWS rows)."""
    x2, M, K = _rows(x, "decode_linear")
    if weight.dim() != 2 or weight.shape[1] != K or not weight.is_contiguous():
        raise ValueError(f"decode_linear needs a contiguous weight [N, {K}], got {tuple(weight.shape)}")
    _check_weight(weight, scale, x, "decode_linear")
    N = weight.shape[0]
    if swiglu and (N % 2 or residual is not None):
        raise ValueError("decode_linear(swiglu=True) needs an even [gate; up] weight and no residual")
    n_out = N // 2 if swiglu else N
    if norm_weight is not None and (norm_weight.shape != (K,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"norm_weight must be {K} values of {x.dtype}, got {tuple(norm_weight.shape)} "
                         f"{norm_weight.dtype}")
    res2 = None
    if residual is not None:
        if residual.numel() != M * N or residual.dtype != x.dtype or not residual.is_contiguous():
            raise ValueError(f"residual must be {M} x {N} contiguous {x.dtype} values, got {tuple(residual.shape)}")
        res2 = residual.view(M, N)
    if out is None:
        out = torch.empty((*x.shape[:-1], n_out), dtype=x.dtype, device=x.device)
    elif out.numel() != M * n_out or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be {M} x {n_out} contiguous {x.dtype} values, got {tuple(out.shape)}")
    elif _overlap(out, x2):
        raise ValueError("decode_linear: out overlaps x (every program reads all of x while others write out)")
    cfg = _config(config, M, n_out, K, swiglu, fp8=scale is not None, elem_bytes=weight.element_size())
    _launch(x2, M, K, weight, cfg, pdl, n_out, out.view(M, n_out), norm_weight=norm_weight, eps=eps, res2=res2,
            pair=1 if swiglu else 0, scale=scale)
    return out


def decode_qkv_rope(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                    positions: torch.Tensor, dst_rows: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    k_dst: torch.Tensor, v_dst: torch.Tensor, n_heads: int, *, seq_rows: int = 0,
                    row_offset: int = 0, seq_q: int = 1, pdl: bool = False,
                    config: DecodeLinearConfig | TileConfig | None = None,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """A decoder layer's attention input for 1 to MAX_ROWS tokens x [..., K], in one launch: the fused q/k/v
    projection of RMSNorm(x) (x itself with `norm_weight` None: an EAGLE draft's first layer) (`weight`
    [(n_heads + 2 KVH) D, K], q rows, then k, then v), RoPE on q and k at
    `positions` (one integer per token), and k (rotated) and v stored into the row stores k_dst / v_dst
    [rows, KVH, D] at `dst_rows` (one per token; skipped when negative), or, with `dst_rows` None, token m (of
    M = B x seq_q) at row (m // seq_q) * seq_rows + row_offset + m % seq_q (a step's stash, as
    `rope_store_triton`'s seq_rows/row_offset). Returns the rotated q [M, n_heads * D].
    Same values as `decode_linear(x, weight, norm_weight=...)` followed by `eyas.kernels.rope_store_triton`
    (`decode_qkv_rope_reference`). `scale`: FP8 codes, as `decode_linear`'s."""
    x2, M, K = _rows(x, "decode_qkv_rope")
    if k_dst.dim() != 3 or v_dst.shape != k_dst.shape or not k_dst.is_contiguous() or not v_dst.is_contiguous():
        raise ValueError(f"k_dst/v_dst must be contiguous row stores [rows, KVH, D], got {tuple(k_dst.shape)} and "
                         f"{tuple(v_dst.shape)}")
    KVH, D = k_dst.shape[1:]
    if D % 2 or weight.dim() != 2 or weight.shape != ((n_heads + 2 * KVH) * D, K) or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} is not a contiguous q/k/v projection of {n_heads} + 2 x "
                         f"{KVH} heads of {D} over {K}")
    _check_weight(weight, scale, x, "decode_qkv_rope")
    if norm_weight is not None and (norm_weight.shape != (K,) or norm_weight.dtype != x.dtype):
        raise ValueError("decode_qkv_rope: norm_weight must be K elements of x's dtype")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D or cos.stride(-1) != 1 or sin.stride(-1) != 1 \
            or sin.stride(0) != cos.stride(0):
        raise ValueError(f"cos/sin tables {tuple(cos.shape)}/{tuple(sin.shape)} must be [max_positions, {D}], "
                         "contiguous rows, alike")
    if positions.numel() != M or (dst_rows is not None and dst_rows.numel() != M):
        raise ValueError(f"decode_qkv_rope takes a position and a destination row per token ({M}), got "
                         f"{positions.numel()} and {dst_rows.numel()}")
    n_pairs = weight.shape[0] // 2
    cfg = _config(config, M, n_pairs, K, True, fp8=scale is not None, elem_bytes=weight.element_size())
    if dst_rows is None and (seq_q < 1 or M % seq_q or seq_rows < 0 or row_offset < 0
                             or row_offset + seq_q > seq_rows or M // seq_q * seq_rows > len(k_dst)):
        raise ValueError(f"decode_qkv_rope without dst_rows needs {M} tokens in sequences of seq_q = {seq_q} whose "
                         f"rows row_offset = {row_offset} .. + seq_q fit seq_rows = {seq_rows} rows each of the "
                         f"{len(k_dst)}")
    q = torch.empty((M, n_heads * D), dtype=x.dtype, device=x.device)
    pos = positions.reshape(M)
    dst = dst_rows.reshape(M) if dst_rows is not None else None
    _launch(x2, M, K, weight, cfg, pdl, n_pairs, q, norm_weight=norm_weight, eps=eps, pair=2, hd=D // 2,
            rope=(cos, sin, pos if pos.stride(0) == 1 else pos.contiguous(),
                  dst if dst is None or dst.stride(0) == 1 else dst.contiguous(), k_dst, v_dst, cos.stride(0),
                  n_heads * D, (n_heads + KVH) * D, KVH * D), stash=(seq_q, seq_rows, row_offset), scale=scale)
    return q


def decode_linear_reference(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                            eps: float = 1e-5, residual: torch.Tensor | None = None,
                            swiglu: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch reference of `decode_linear`: the unfused modules' operations (float32 GEMV; FP8 codes
    dequantised as `eyas.layers.linear_fp8.dequantize_fp8`)."""
    h = rms_norm(x, norm_weight, eps) if norm_weight is not None else x
    w = weight.float() if scale is None else dequantize_fp8(weight, scale)
    y = (h.float() @ w.T).to(x.dtype)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = residual.view(y.shape) + y
    return y


def decode_qkv_rope_reference(x, weight, norm_weight, eps, positions, dst_rows, cos, sin, k_dst, v_dst,
                              n_heads: int, *, seq_rows: int = 0, row_offset: int = 0, seq_q: int = 1,
                              scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch reference of `decode_qkv_rope`: the normed projection, then `rope_store_reference`."""
    from eyas.kernels.fused_rope import rope_store_reference
    KVH, D = k_dst.shape[1:]
    M = x.numel() // x.shape[-1]
    B, Q = (1, M) if dst_rows is not None else (M // seq_q, seq_q)
    qkv = decode_linear_reference(x.reshape(M, -1), weight, norm_weight=norm_weight, eps=eps,
                                  scale=scale).view(B, Q, -1)
    q, k, v = qkv.split([n_heads * D, KVH * D, KVH * D], dim=-1)
    where = dict(rows=dst_rows.reshape(B, Q)) if dst_rows is not None else dict(seq_rows=seq_rows,
                                                                               row_offset=row_offset)
    q = rope_store_reference(positions.reshape(B, Q), q.view(B, Q, n_heads, D), k.view(B, Q, KVH, D),
                             v.view(B, Q, KVH, D), cos, sin, k_dst, v_dst, **where)
    return q.reshape(M, -1)
