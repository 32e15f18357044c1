"""The sampling filters (top-k, min-p, top-p) as one threshold per row, found by bisection instead of a sort.

`eyas.layers.sampler.logits_to_probs` sorts every row of a filtered step: on an H100 the sort was 0.53 ms of the
default tree's step at batch 1 and 5.15 ms at batch 16 (session 58), for 49 and 784 rows of 49,152 logits. The
filters only need, per row, the value tau above which tokens stay (`eyas.layers.sampler.filter_threshold`, the
reference, defines it; ties at a boundary all stay):

* top-k: the k-th largest x, the largest float key v with count(x >= v) >= k (32 halvings of the float keys);
* min-p: M + log(min_p);
* top-p: the smallest key v with sum(exp(x - M) over the kept tokens above v) < top_p * their mass (32 more), the
  masses in fixed point (floor(exp(x - M) * 2^32): integer sums agree in any order, so the boundary does not move
  with the order of a sum, as it did between a chunked and a sorted float sum at top-p 0.999).

One program per row. Up to `ROW_MAX` entries it holds the whole row in registers (`_threshold_row_kernel`) and
reads the logits once; past that it walks the row in chunks, ~70 passes over the logits (`_threshold_kernel`; on an
H100 that took ~1 ms a row at any batch below ~100 rows, slower than the sort there: session 60). It returns the
threshold, the maximum, the kept tokens' mass and the argmax; the acceptance then reads the children's
probabilities and races the bonus among x >= tau. Off in the step (`eyas.spec.step.SORT_FREE_FILTERS`) until it
wins on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import exp_rn, interpreting, log_rn
from eyas.kernels.race import temperature_of, tempered_chunk


@triton.jit
def _key(x):
    """float32 -> int64 keys in the floats' order."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _unkey(k):
    b = k.to(tl.int32)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _fixed(d, PRECISE: tl.constexpr):
    """exp(d) for d <= 0 in fixed point: floor(exp(d) * 2^32) as int64 (exact; sums agree in any order)."""
    return tl.floor(exp_rn(d, PRECISE) * 4294967296.0).to(tl.int64)


@triton.jit
def _threshold_kernel(X, T, K, P, MINP, TAU, M_OUT, Z_OUT, TOP, V, stride,
                      BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t, greedy = temperature_of(T, r)
    # the maximum and the first argmax
    m = float("-inf")
    top = 0
    for c in range(0, V, BLOCK):
        x, offs, ok = tempered_chunk(X, r, c, stride, V, t, BLOCK, PRECISE)
        cm = tl.max(x, axis=0)
        ci = tl.min(tl.where((x == cm) & ok, offs, 2147483647), axis=0)
        top = tl.where(cm > m, ci, top)
        m = tl.maximum(m, cm)
    shift = tl.where(m == float("-inf"), 0.0, m)
    tau = float("-inf")
    k = tl.load(K + r).to(tl.int64)
    if (k > 0) & (k < V) & (~greedy):  # top-k: the largest key v with count(x >= v) >= k
        lo = _key(tl.full([], float("-inf"), tl.float32))
        hi = _key(m) + 1
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            cnt = 0
            for c in range(0, V, BLOCK):
                x, offs, ok = tempered_chunk(X, r, c, stride, V, t, BLOCK, PRECISE)
                cnt += tl.sum(tl.where(ok & (_key(x) >= mid), 1, 0), axis=0)
            big = cnt >= k
            lo = tl.where(big, mid, lo)
            hi = tl.where(big, hi, mid)
        tau = _unkey(lo)
    mp = tl.load(MINP + r).to(tl.float32)
    if (mp > 0.0) & (~greedy):  # min-p
        tau = tl.maximum(tau, m + log_rn(mp, PRECISE))
    p = tl.load(P + r).to(tl.float32)
    if (p < 1.0) & (~greedy):  # top-p among the tokens kept so far: the smallest key v whose mass above < p * mass
        z = tl.zeros([], dtype=tl.int64)  # masses in fixed point, as the reference's: sums in any order agree
        for c in range(0, V, BLOCK):
            x, offs, ok = tempered_chunk(X, r, c, stride, V, t, BLOCK, PRECISE)
            z += tl.sum(tl.where(ok & (x >= tau), _fixed(x - shift, PRECISE), 0), axis=0)
        target = p.to(tl.float64) * z.to(tl.float64)
        lo = _key(tau) - 1  # the mass above lo (every kept token) is z >= target
        hi = _key(m)  # nothing above the maximum: 0 < target
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            above = tl.zeros([], dtype=tl.int64)
            for c in range(0, V, BLOCK):
                x, offs, ok = tempered_chunk(X, r, c, stride, V, t, BLOCK, PRECISE)
                above += tl.sum(tl.where(ok & (x >= tau) & (_key(x) > mid), _fixed(x - shift, PRECISE), 0), axis=0)
            small = above.to(tl.float64) < target
            hi = tl.where(small, mid, hi)
            lo = tl.where(small, lo, mid)
        tau = tl.maximum(tau, _unkey(hi))
    tau = tl.where(greedy, m, tau)
    # the smallest kept x (the threshold as the reference states it) and the kept tokens' mass
    lowest = float("inf")
    z = 0.0
    for c in range(0, V, BLOCK):
        x, offs, ok = tempered_chunk(X, r, c, stride, V, t, BLOCK, PRECISE)
        keep = ok & (x >= tau)
        lowest = tl.minimum(lowest, tl.min(tl.where(keep, x, float("inf")), axis=0))
        z += tl.sum(tl.where(keep, exp_rn(x - shift, PRECISE), 0.0), axis=0)
    tl.store(TAU + r, lowest)
    tl.store(M_OUT + r, m)
    tl.store(Z_OUT + r, z)
    tl.store(TOP + r, top.to(tl.int64))


@triton.jit
def _threshold_row_kernel(X, T, K, P, MINP, TAU, M_OUT, Z_OUT, TOP, V, stride,
                          VB: tl.constexpr, PRECISE: tl.constexpr):
    """`_threshold_kernel` with the whole row in registers (VB >= V): one read of the logits, then each halving is a
    pass over registers, not over L2."""
    r = tl.program_id(0).to(tl.int64)
    t, greedy = temperature_of(T, r)
    x, offs, ok = tempered_chunk(X, r, 0, stride, V, t, VB, PRECISE)
    m = tl.max(x, axis=0)
    top = tl.min(tl.where((x == m) & ok, offs, 2147483647), axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    keys = _key(x)
    tau = float("-inf")
    k = tl.load(K + r).to(tl.int64)
    if (k > 0) & (k < V) & (~greedy):  # top-k: the largest key v with count(x >= v) >= k
        lo = _key(tl.full([], float("-inf"), tl.float32))
        hi = _key(m) + 1
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            big = tl.sum(tl.where(ok & (keys >= mid), 1, 0), axis=0) >= k
            lo = tl.where(big, mid, lo)
            hi = tl.where(big, hi, mid)
        tau = _unkey(lo)
    mp = tl.load(MINP + r).to(tl.float32)
    if (mp > 0.0) & (~greedy):  # min-p
        tau = tl.maximum(tau, m + log_rn(mp, PRECISE))
    p = tl.load(P + r).to(tl.float32)
    if (p < 1.0) & (~greedy):  # top-p among the tokens kept so far, the masses in fixed point
        mass = tl.where(ok & (x >= tau), _fixed(x - shift, PRECISE), 0)
        target = p.to(tl.float64) * tl.sum(mass, axis=0).to(tl.float64)
        lo = _key(tau) - 1
        hi = _key(m)
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            small = tl.sum(tl.where(keys > mid, mass, 0), axis=0).to(tl.float64) < target
            hi = tl.where(small, mid, hi)
            lo = tl.where(small, lo, mid)
        tau = tl.maximum(tau, _unkey(hi))
    tau = tl.where(greedy, m, tau)
    keep = ok & (x >= tau)
    tl.store(TAU + r, tl.min(tl.where(keep, x, float("inf")), axis=0))
    tl.store(M_OUT + r, m)
    tl.store(Z_OUT + r, tl.sum(tl.where(keep, exp_rn(x - shift, PRECISE), 0.0), axis=0))
    tl.store(TOP + r, top.to(tl.int64))


# The whole row in registers up to this many entries (a power of two; SmolLM2's and Llama 2's vocabularies fit),
# one program of ROW_WARPS warps a row; past it the row is walked in chunks, once per halving.
ROW_MAX = 65536
ROW_WARPS = 16


def filter_threshold_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, min_p: torch.Tensor, whole_row: bool | None = None):
    """`eyas.layers.sampler.filter_threshold` in one launch: (tau, M, Z) float32 [R], top int64 [R]."""
    x = logits.reshape(-1, logits.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, V = x.shape
    dev = x.device
    tau, M, Z = (torch.empty(R, dtype=torch.float32, device=dev) for _ in range(3))
    top = torch.empty(R, dtype=torch.long, device=dev)
    settings = (temperature.float().contiguous(), top_k.contiguous(), top_p.float().contiguous(),
                min_p.float().contiguous())
    VB = triton.next_power_of_2(V)
    if whole_row is None:
        whole_row = VB <= ROW_MAX
    if R and whole_row:
        _threshold_row_kernel[(R,)](x, *settings, tau, M, Z, top, V, x.stride(0), VB=VB, PRECISE=not interpreting(),
                                    num_warps=ROW_WARPS)
    elif R:
        _threshold_kernel[(R,)](x, *settings, tau, M, Z, top, V, x.stride(0), BLOCK=min(2048, VB),
                                PRECISE=not interpreting(), num_warps=8)
    return tau, M, Z, top
