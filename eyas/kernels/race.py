"""A sampled step's passes over the vocabulary in Triton: the rows' statistics for the acceptance rounds, and the
exponential race that samples a token.

PyTorch reduces a 49k-wide row in one block (~13 us on the H200 for an argmax), and the softmax-then-inverse-CDF
sampler took ~17 such kernels a draw, over [rows, V] float32 copies of the logits. Here each pass reads the bf16
logits once, cut into chunks of BLOCK entries so that one row fills many SMs:

- `row_stats_triton`: per row of x = logits / t, the maximum M, Z = sum exp(x - M) and the first argmax (pass 1 per
  chunk, pass 2 merges the chunks). The acceptance rounds read p_i = exp(x_i - M) / Z at the children's tokens only.
- `race_sample_triton`: per row, the token with the largest x_i - log(E_i), E_i ~ Exp(1) from the counter-based
  hash (`eyas.layers.sampler.race_exponentials`), excluding the tokens a step tried and rejected; t <= 0: the
  argmax. Pass 1 keeps each chunk's winner, pass 2 the row's (the lower index among equal scores).

The references are `eyas.layers.sampler.row_stats` and `race_sample`: the same float32 formulas, so the results
agree up to the last bit of `exp`/`log` (a race decided by one ulp could go the other way).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import div_rn, exp_rn, gdc_prologue, interpreting, log_rn, neg_log1p_neg_rn, pdl_on
from eyas.kernels.uniform import hash24

BLOCK = 2048  # entries per chunk (pass 1)
PDL = True  # programmatic dependent launch, as `eyas.kernels.chunk_topk`
_BIG = tl.constexpr(2147483647)


@triton.jit
def temperature_of(T, r):
    """(t, greedy) of row r's temperature: a greedy row (t <= 0) divides by 1."""
    t = tl.load(T + r).to(tl.float32)
    return tl.where(t <= 0.0, 1.0, t), t <= 0.0


@triton.jit
def tempered_chunk(X, row, start, stride_xr, V, t, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    """Entries start .. start + BLOCK of logits row `row` as x = logits / t (IEEE-rounded), -inf past V: (x, offsets,
    in range)."""
    offs = start + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(X + row * stride_xr + offs, mask=ok, other=float("-inf")).to(tl.float32)
    return div_rn(x, t, PRECISE), offs, ok


@triton.jit
def _stats_kernel(X, T, STATS, IDX, V, n_chunks, stride_xr, BLOCK: tl.constexpr, PRECISE: tl.constexpr,
                  USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    r = tl.program_id(0).to(tl.int64)
    t, _ = temperature_of(T, r)
    x, offs, ok = tempered_chunk(X, r, tl.program_id(1) * BLOCK, stride_xr, V, t, BLOCK, PRECISE)
    cm = tl.max(x, axis=0)
    shift = tl.where(cm == float("-inf"), 0.0, cm)
    o = r * n_chunks + tl.program_id(1)
    tl.store(STATS + o * 2, cm)
    tl.store(STATS + o * 2 + 1, tl.sum(tl.where(ok, exp_rn(x - shift, PRECISE), 0.0), axis=0))
    tl.store(IDX + o, tl.min(tl.where((x == cm) & ok, offs, _BIG), axis=0))


@triton.jit
def _stats_merge_kernel(STATS, IDX, M, Z, TOP, n_chunks, BLOCK_C: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    r = tl.program_id(0).to(tl.int64)
    oc = tl.arange(0, BLOCK_C)
    okc = oc < n_chunks
    cm = tl.load(STATS + (r * n_chunks + oc) * 2, mask=okc, other=float("-inf"))
    cs = tl.load(STATS + (r * n_chunks + oc) * 2 + 1, mask=okc, other=0.0)
    ci = tl.load(IDX + r * n_chunks + oc, mask=okc, other=_BIG)
    mx = tl.max(cm, axis=0)
    shift = tl.where(mx == float("-inf"), 0.0, mx)
    tl.store(M + r, mx)
    tl.store(Z + r, tl.sum(cs * tl.exp(cm - shift), axis=0))  # a chunk of -inf: cs = 0
    tl.store(TOP + r, tl.min(tl.where((cm == mx) & okc, ci, _BIG), axis=0).to(tl.int64))


@triton.jit
def _race_kernel(X, ROWS, T, SEEDS, CNT, BASE, EXCL, TAU, SCORE, IDX, V, n_chunks, stride_xr, W,
                 BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr, PRECISE: tl.constexpr, HAS_TAU: tl.constexpr = False,
                 USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(ROWS + r) if HAS_ROWS else r
    t, greedy = temperature_of(T, r)
    x, offs, ok = tempered_chunk(X, row, tl.program_id(1) * BLOCK, stride_xr, V, t, BLOCK, PRECISE)
    x0 = x
    if not greedy:
        k = tl.minimum(hash24(SEEDS, CNT, r, tl.load(BASE + r).to(tl.int64) + offs) + 1, 16777215)
        v = k.to(tl.float32) * (1.0 / 16777216.0)  # exact: a power of two
        x = x - log_rn(neg_log1p_neg_rn(v, PRECISE), PRECISE)  # E = -log(1 - v), to an ulp even where E is small
    if HAS_TAU:  # the filters' threshold: only x >= tau takes part
        x = tl.where(x0 >= tl.load(TAU + r), x, float("-inf"))
    for j in range(W):
        e = tl.load(EXCL + r * W + j)
        x = tl.where(offs == e, float("-inf"), x)
    best = tl.max(x, axis=0)
    o = r * n_chunks + tl.program_id(1)
    tl.store(SCORE + o, best)
    tl.store(IDX + o, tl.min(tl.where((x == best) & ok, offs, _BIG), axis=0))


@triton.jit
def _race_merge_kernel(SCORE, IDX, OUT, n_chunks, stride_out, BLOCK_C: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    r = tl.program_id(0).to(tl.int64)
    oc = tl.arange(0, BLOCK_C)
    okc = oc < n_chunks
    s = tl.load(SCORE + r * n_chunks + oc, mask=okc, other=float("-inf"))
    ci = tl.load(IDX + r * n_chunks + oc, mask=okc, other=_BIG)
    best = tl.max(s, axis=0)
    tok = tl.min(tl.where((s == best) & okc, ci, _BIG), axis=0)
    # every token excluded: token 0, as the reference
    tl.store(OUT + r * stride_out, tl.where(tok == _BIG, 0, tok).to(tl.int64))


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def row_stats_triton(logits: torch.Tensor, temperature: torch.Tensor):
    """`eyas.layers.sampler.row_stats` in two launches: (M, Z) float32 [R], top int64 [R] for logits [R, V]."""
    x = _rows(logits)
    R, V = x.shape
    dev = x.device
    M = torch.empty(R, dtype=torch.float32, device=dev)
    Z = torch.empty(R, dtype=torch.float32, device=dev)
    top = torch.empty(R, dtype=torch.long, device=dev)
    if R:
        temperature = temperature.contiguous()
        n = triton.cdiv(V, BLOCK)
        stats = torch.empty((R, n, 2), dtype=torch.float32, device=dev)
        idx = torch.empty((R, n), dtype=torch.int32, device=dev)
        use_gdc, pdl = pdl_on(PDL, dev)
        _stats_kernel[(R, n)](x, temperature, stats, idx, V, n, x.stride(0), BLOCK=BLOCK, PRECISE=not interpreting(),
                              USE_GDC=use_gdc,
                              num_warps=4, **pdl)
        _stats_merge_kernel[(R,)](stats, idx, M, Z, top, n, BLOCK_C=triton.next_power_of_2(n), USE_GDC=use_gdc,
                                  num_warps=1, **pdl)
    return M, Z, top


def race_sample_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                       counters: torch.Tensor, index_base: torch.Tensor, exclude: torch.Tensor | None = None,
                       rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
                       tau: torch.Tensor | None = None) -> torch.Tensor:
    """`eyas.layers.sampler.race_sample` in two launches: tokens int64 [R]. logits [R, V], or [N, V] with `rows` [R]
    (int64) picking the R rows to draw from (a step's stop nodes, without copying them out); the other inputs [R],
    exclude [R, W] (-1: none). `out`: an int64 [R] view (any stride) to write the tokens into. `tau` [R]: the
    filters' threshold (`eyas.layers.sampler.filter_threshold`)."""
    x = _rows(logits)
    V = x.shape[-1]
    R = temperature.shape[0]
    dev = x.device
    if out is None:
        out = torch.empty(R, dtype=torch.long, device=dev)
    if R:
        temperature, seeds, counters, index_base = (x.contiguous() for x in (temperature, seeds, counters, index_base))
        n = triton.cdiv(V, BLOCK)
        score = torch.empty((R, n), dtype=torch.float32, device=dev)
        idx = torch.empty((R, n), dtype=torch.int32, device=dev)
        W = 0 if exclude is None else exclude.shape[1]
        excl = exclude.contiguous() if W else out  # (never read when W = 0)
        use_gdc, pdl = pdl_on(PDL, dev)
        taus = tau.float().contiguous() if tau is not None else score  # (never read without tau)
        _race_kernel[(R, n)](x, rows if rows is not None else out, temperature, seeds, counters, index_base, excl,
                             taus, score, idx, V, n, x.stride(0), W, BLOCK=BLOCK, HAS_ROWS=rows is not None,
                             PRECISE=not interpreting(), HAS_TAU=tau is not None, USE_GDC=use_gdc, num_warps=4,
                             **pdl)
        _race_merge_kernel[(R,)](score, idx, out, n, out.stride(0), BLOCK_C=triton.next_power_of_2(n),
                                 USE_GDC=use_gdc, num_warps=1, **pdl)
    return out
