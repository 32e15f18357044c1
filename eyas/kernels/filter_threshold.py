"""The sampling filters (top-k, min-p, top-p) as one threshold per row, found by radix selection instead of a sort.

`eyas.layers.sampler.logits_to_probs` sorts every row of a filtered step. The filters only need, per row, the value
tau above which tokens stay (`eyas.layers.sampler.filter_threshold`, the reference, defines it; ties at a boundary
all stay):

* top-k: the k-th largest x, the largest float key v with count(x >= v) >= k;
* min-p: M + log(min_p);
* top-p: the smallest key v with sum(exp(x - M) over the kept tokens above v) < top_p * their mass, the masses in
  fixed point (floor(exp(x - M) * 2^32): integer sums agree in any order, so the boundary does not move with the
  order of a sum, as it did between a chunked and a sorted float sum at top-p 0.999).

The 32-bit keys of the floats are resolved from the top bits down in three levels (11, 11 and 10 bits): a level's
histogram (`_hist_kernel`, programs across the whole row: counts for top-k, fixed-point masses for top-p, integer
atomics, so the sums do not depend on their order) over the entries whose higher bits match the prefix found so
far, then one program a row (`_scan_kernel`) takes the bucket where the count or the mass crosses and carries what
lies above it. Then a pass in chunks gives the smallest kept x and the kept mass, merged in a fixed order. 15
Triton launches (the row statistics' two, six histograms, six scans, the last pass; the histograms and the passes
spread across the row), then two small reductions: on an H100 (`tools/diag/sampler_cost.py --graph`, session 60)
0.061 ms for one row of 49,152 bf16 logits, 0.130 for 49, 0.319 for 192, 2.31 for 1,568, against the sort's 0.53,
0.71, 2.23 and 14.9. The acceptance then reads the children's probabilities and races the bonus among x >= tau.

Tried in sessions 59-60, not kept (ms for 1 / 49 / 192 / 1,568 rows on an H100): one program a row bisecting the
keys, ~70 passes over the row in chunks (0.98 / 0.98 / 1.23 / 5.88: each pass bound by its chunks' latency); the
same holding the whole row in registers (0.52 / 0.95 / 2.96 / 23.2); 4- and 16-way searches counted per lane
(0.88 / 0.87 / 1.11 / 6.19 and 0.99 / 0.91 / 1.89 / 11.1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import exp_rn, interpreting, log_rn
from eyas.kernels.race import temperature_of, tempered_chunk


@triton.jit
def _fixed(d, PRECISE: tl.constexpr):
    """exp(d) for d <= 0 in fixed point: floor(exp(d) * 2^32) as int64 (exact; sums agree in any order)."""
    return tl.floor(exp_rn(d, PRECISE) * 4294967296.0).to(tl.int64)


LEVELS = ((21, 32, 11), (10, 21, 11), (0, 10, 10))  # (shift, the prefix's shift, bits), from the top bits down
NB = 2048  # buckets a histogram row holds (the widest level's)
CHUNK = 2048  # entries a histogram program reads


@triton.jit
def _ukey(x):
    """float32 -> keys in [0, 2^32) as int64, in the floats' order."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64) + 2147483648


@triton.jit
def _unukey(u):
    b = (u - 2147483648).to(tl.int32)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _tau_km(r, K, MINP, PREFIX_K, m, greedy, V, PRECISE: tl.constexpr):
    """Row r's threshold after top-k and min-p (top-k's key from its last scan; -inf where neither filters)."""
    k = tl.load(K + r).to(tl.int64)
    tau = tl.where((k > 0) & (k < V) & (~greedy), _unukey(tl.load(PREFIX_K + r)), float("-inf"))
    mp = tl.load(MINP + r).to(tl.float32)
    return tl.where((mp > 0.0) & (~greedy), tl.maximum(tau, m + log_rn(tl.maximum(mp, 1e-30), PRECISE)), tau)


@triton.jit
def _active(r, T, K, P, V, MASS: tl.constexpr):
    t, greedy = temperature_of(T, r)
    if MASS:
        on = (tl.load(P + r).to(tl.float32) < 1.0) & (~greedy)
    else:
        k = tl.load(K + r).to(tl.int64)
        on = (k > 0) & (k < V) & (~greedy)
    return on, t, greedy


@triton.jit
def _hist_kernel(X, T, K, P, MINP, M_IN, PREFIX_K, PREFIX, HIST, V, stride,
                 SHIFT: tl.constexpr, HI: tl.constexpr, MASS: tl.constexpr, NBR: tl.constexpr,
                 CHUNK: tl.constexpr, PRECISE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    on, t, greedy = _active(r, T, K, P, V, MASS)
    if on:
        x, offs, ok = tempered_chunk(X, r, tl.program_id(1) * CHUNK, stride, V, t, CHUNK, PRECISE)
        u = _ukey(x)
        prefix = tl.load(PREFIX + r) if HI < 32 else 0
        inreg = ok & ((u >> HI) == prefix)
        bucket = (u >> SHIFT) & ((1 << (HI - SHIFT)) - 1)
        if MASS:
            m = tl.load(M_IN + r)
            shift = tl.where(m == float("-inf"), 0.0, m)
            inreg = inreg & (x >= _tau_km(r, K, MINP, PREFIX_K, m, greedy, V, PRECISE))
            tl.atomic_add(HIST + r * NBR + bucket, _fixed(x - shift, PRECISE), mask=inreg)
        else:
            tl.atomic_add(HIST + r * NBR + bucket, tl.full([CHUNK], 1, tl.int64), mask=inreg)


@triton.jit
def _scan_kernel(T, K, P, HIST, PREFIX, BASE, TARGET, V, BITS: tl.constexpr, FIRST: tl.constexpr,
                 MASS: tl.constexpr, NBR: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    on, t, greedy = _active(r, T, K, P, V, MASS)
    if on:
        i = tl.arange(0, NBR)  # from the top bucket down
        valid = i < (1 << BITS)
        b = (1 << BITS) - 1 - i
        h = tl.load(HIST + r * NBR + b, mask=valid, other=0)
        tl.store(HIST + r * NBR + b, tl.zeros([NBR], tl.int64), mask=valid)  # clean for the next level
        cum = tl.cumsum(h, axis=0)
        excl = cum - h
        prefix = tl.zeros([], tl.int64) if FIRST else tl.load(PREFIX + r)
        base = tl.zeros([], tl.int64) if FIRST else tl.load(BASE + r)
        if MASS:  # the lowest bucket whose mass above stays below top_p of the kept mass
            if FIRST:
                target = tl.load(P + r).to(tl.float64) * tl.sum(h, axis=0).to(tl.float64)
                tl.store(TARGET + r, target)
            else:
                target = tl.load(TARGET + r)
            star = tl.maximum(tl.max(tl.where(valid & ((base + excl).to(tl.float64) < target), i, -1), axis=0), 0)
        else:  # the first bucket from the top where the count reaches k
            star = tl.min(tl.where(valid & (base + cum >= tl.load(K + r).to(tl.int64)), i, NBR), axis=0)
        tl.store(BASE + r, base + tl.sum(tl.where(i == star, excl, 0), axis=0))
        tl.store(PREFIX + r, (prefix << BITS) | ((1 << BITS) - 1 - star))


@triton.jit
def _final_kernel(X, T, K, P, MINP, M_IN, PREFIX_K, PREFIX_P, LOW, ZP, V, stride, n_chunks,
                  CHUNK: tl.constexpr, PRECISE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    on_p, t, greedy = _active(r, T, K, P, V, True)
    m = tl.load(M_IN + r)
    tau = _tau_km(r, K, MINP, PREFIX_K, m, greedy, V, PRECISE)
    tau = tl.where(on_p, tl.maximum(tau, _unukey(tl.load(PREFIX_P + r))), tau)
    tau = tl.where(greedy, m, tau)
    x, offs, ok = tempered_chunk(X, r, c * CHUNK, stride, V, t, CHUNK, PRECISE)
    keep = ok & (x >= tau)
    shift = tl.where(m == float("-inf"), 0.0, m)
    tl.store(LOW + r * n_chunks + c, tl.min(tl.where(keep, x, float("inf")), axis=0))
    tl.store(ZP + r * n_chunks + c, tl.sum(tl.where(keep, exp_rn(x - shift, PRECISE), 0.0), axis=0))


def filter_threshold_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, min_p: torch.Tensor):
    """`eyas.layers.sampler.filter_threshold` by radix selection: (tau, M, Z) float32 [R], top int64 [R]. The row
    statistics (`row_stats_triton`), three histogram levels and their scans for top-k, three for top-p, and a final
    pass in chunks (the smallest kept x and the kept mass, merged in a fixed order)."""
    from eyas.kernels.race import row_stats_triton
    x = logits.reshape(-1, logits.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, V = x.shape
    dev = x.device
    if not R:
        return tuple(torch.empty(0, dtype=d, device=dev) for d in (torch.float32,) * 3 + (torch.long,))
    T, K = temperature.float().contiguous(), top_k.contiguous()
    P, MP = top_p.float().contiguous(), min_p.float().contiguous()
    M, _, top = row_stats_triton(x, T)
    hist = torch.zeros(R, NB, dtype=torch.long, device=dev)
    pk, pp, base = (torch.zeros(R, dtype=torch.long, device=dev) for _ in range(3))
    target = torch.zeros(R, dtype=torch.float64, device=dev)
    n = triton.cdiv(V, CHUNK)
    precise = not interpreting()
    for mass, prefix in ((False, pk), (True, pp)):
        for level, (shift, hi, bits) in enumerate(LEVELS):
            _hist_kernel[(R, n)](x, T, K, P, MP, M, pk, prefix, hist, V, x.stride(0), SHIFT=shift, HI=hi, MASS=mass,
                                 NBR=NB, CHUNK=CHUNK, PRECISE=precise, num_warps=8)
            _scan_kernel[(R,)](T, K, P, hist, prefix, base, target, V, BITS=bits, FIRST=level == 0, MASS=mass,
                               NBR=NB, num_warps=8)
    low = torch.empty(R, n, dtype=torch.float32, device=dev)
    zp = torch.empty(R, n, dtype=torch.float32, device=dev)
    _final_kernel[(R, n)](x, T, K, P, MP, M, pk, pp, low, zp, V, x.stride(0), n, CHUNK=CHUNK, PRECISE=precise,
                          num_warps=8)
    return low.amin(1), M, zp.sum(1), top
