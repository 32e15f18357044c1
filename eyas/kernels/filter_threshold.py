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

One program per row walks its row in chunks: ~70 passes over 49,152 bf16 logits (L2-resident) where the sort moved
every row through global memory several times. It returns the threshold, the maximum, the kept tokens' mass and the
argmax; the acceptance then reads the children's probabilities and races the bonus among x >= tau.

On an H100 (`tools/diag/sampler_cost.py --device cuda`, session 60) a pass costs ~15 us whatever the row count, its
chunks' latency: ~1 ms for one row or 49 (the sort: 0.53, 0.71), 1.22 ms for 192 rows (2.22) and 5.86 for 1,568
(14.9). So the step sorts below `eyas.spec.step.SORT_FREE_MIN_ROWS` rows. Tried in session 60, not kept:
* the whole row in registers (one read of the logits, 16 warps): 0.52 ms for one row, 0.95 for 49, but 2.96 for
  192 and 23.2 for 1,568;
* searches of 4 or 16 candidates a pass, counted per lane and summed after the pass (fewer passes): 4-way 0.88,
  0.87, 1.11 and 6.19 ms; 16-way 0.99, 0.91, 1.89 and 11.1 (each pass then bound by its 512-entry chunks' latency
  or by the NWAY compares of each entry).
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


def filter_threshold_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, min_p: torch.Tensor):
    """`eyas.layers.sampler.filter_threshold` in one launch: (tau, M, Z) float32 [R], top int64 [R]."""
    x = logits.reshape(-1, logits.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, V = x.shape
    dev = x.device
    tau, M, Z = (torch.empty(R, dtype=torch.float32, device=dev) for _ in range(3))
    top = torch.empty(R, dtype=torch.long, device=dev)
    if R:
        _threshold_kernel[(R,)](x, temperature.float().contiguous(), top_k.contiguous(), top_p.float().contiguous(),
                                min_p.float().contiguous(), tau, M, Z, top, V, x.stride(0),
                                BLOCK=min(2048, triton.next_power_of_2(V)), PRECISE=not interpreting(), num_warps=8)
    return tau, M, Z, top
