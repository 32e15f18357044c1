"""Top-k indices over a wide last dimension in two Triton launches (the draft's candidates at every tree level, and
argmax, k = 1).

On the H200 a level's `torch.topk` over SmolLM2's 49k logits took ~30 us in 3-5 kernels (a radix select per chunk,
a bitonic sort, gathers), and `argmax` over one 49k row ~13 us in one single-block reduction: the largest cost of a
tree level after the draft forward itself (session 6 profile, docs/benchmarks.md). Here:

1. one program per (row, chunk of BLOCK entries) takes its chunk's k largest by k rounds of max, and
2. one program per row takes the k largest of those n_chunks x k candidates the same way.

Values are compared in float32 (exact for bf16/fp16 inputs). Among equal values the lower index comes first, so
k = 1 is `argmax` (its first maximum) and the result is `torch.topk(x, k).indices` whenever the top values do not
tie. NaN is not supported. The reference is `eyas.layers.topk.topk_indices` (torch.topk).

`topk_logp_triton` also gives the k winners' log-softmax values (a dynamic tree scores its candidates by them) in the
same two launches: pass 1 keeps each chunk's maximum and sum of exponentials beside its winners, pass 2 merges them
into the row's log-sum-exp. PyTorch's float32 `logsumexp` over a 49k row took ~17 kernels (~45 us) a tree level on
the H200 (session 29). The reference is `eyas.layers.topk.topk_logp_torch`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import gdc_prologue, pdl_on
from eyas.layers.topk import MAX_K

BLOCK = 2048  # entries per chunk (pass 1)
# Programmatic dependent launch for both passes (each program lets the next kernel launch, then waits for the
# previous one before it reads): a tree level's top-k sits between the draft's head and `draft_pairs`, which
# launched after a ~0.4 us gap each in session 39's profile. On since session 40, with `draft_pairs.PDL`: on the real
# SmolLM2 the default tree's step 1.072-1.075 ms against main's 1.078-1.084 alone, 1.055-1.067 with the catch-up on
# the tiles (`eyas.spec.drafter.CATCHUP_ROWS`; `docs/benchmarks.md`, "Session 40").
PDL = True


@triton.jit
def _chunk_topk_kernel(X, VOUT, IOUT, STATS, V, n_chunks, stride_xr, K: tl.constexpr, BLOCK: tl.constexpr,
                       LSE: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(X + r * stride_xr + offs, mask=ok, other=float("-inf")).to(tl.float32)
    out = (r * n_chunks + c) * K
    if LSE:  # the chunk's maximum and its sum of exp(x - maximum) (0 for a chunk of -inf)
        cm = tl.max(x, axis=0)
        shift = tl.where(cm == float("-inf"), 0.0, cm)
        tl.store(STATS + (r * n_chunks + c) * 2, cm)
        tl.store(STATS + (r * n_chunks + c) * 2 + 1, tl.sum(tl.where(ok, tl.exp(x - shift), 0.0), axis=0))
    for j in tl.static_range(K):
        m = tl.max(x, axis=0)
        idx = tl.min(tl.where((x == m) & ok, offs, 2147483647), axis=0)  # the first of the maxima
        tl.store(VOUT + out + j, m)
        tl.store(IOUT + out + j, idx)
        x = tl.where(offs == idx, float("-inf"), x)
        ok = ok & (offs != idx)


@triton.jit
def _merge_topk_kernel(VIN, IIN, OUT, STATS, LOGP, n_cand, n_chunks, K: tl.constexpr, BLOCK: tl.constexpr,
                       LSE: tl.constexpr, BLOCK_C: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_cand
    v = tl.load(VIN + r * n_cand + offs, mask=ok, other=float("-inf"))
    ids = tl.load(IIN + r * n_cand + offs, mask=ok, other=2147483647)
    lse = 0.0
    if LSE:  # the row's log-sum-exp from its chunks' (maximum, sum of exponentials)
        oc = tl.arange(0, BLOCK_C)
        okc = oc < n_chunks
        cm = tl.load(STATS + (r * n_chunks + oc) * 2, mask=okc, other=float("-inf"))
        cs = tl.load(STATS + (r * n_chunks + oc) * 2 + 1, mask=okc, other=0.0)
        mx = tl.max(cm, axis=0)
        shift = tl.where(mx == float("-inf"), 0.0, mx)
        lse = shift + tl.log(tl.sum(cs * tl.exp(cm - shift), axis=0))  # a -inf chunk: cs = 0 (pass 1), exp -> 0
    for j in tl.static_range(K):
        m = tl.max(v, axis=0)
        idx = tl.min(tl.where((v == m) & ok, ids, 2147483647), axis=0)
        tl.store(OUT + r * K + j, idx.to(tl.int64))
        if LSE:
            tl.store(LOGP + r * K + j, tl.minimum(m - lse, 0.0))
        hit = ids == idx
        v = tl.where(hit, float("-inf"), v)
        ok = ok & (~hit)


def topk_indices_triton(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] (int64) of the k largest entries of x [..., V] along the last dimension, largest first (ties:
    lower index first). k <= 16 and V >= k."""
    return _topk(x, k, lse=False)[1]


def topk_logp_triton(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(x)'s k largest values [..., k] in float32, clamped to <= 0; their indices [..., k] int64), as
    `topk_indices_triton` orders them."""
    return _topk(x, k, lse=True)


def _topk(x: torch.Tensor, k: int, lse: bool):
    V = x.shape[-1]
    if not 1 <= k <= min(MAX_K, V):
        raise ValueError(f"k must be in [1, {min(MAX_K, V)}], got {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, V)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    out = torch.empty((R, k), dtype=torch.long, device=x.device)
    logp = torch.empty((R, k), dtype=torch.float32, device=x.device) if lse else None
    if R > 0:
        n = triton.cdiv(V, BLOCK)
        vals = torch.empty((R, n, k), dtype=torch.float32, device=x.device)
        ids = torch.empty((R, n, k), dtype=torch.int32, device=x.device)
        stats = torch.empty((R, n, 2), dtype=torch.float32, device=x.device) if lse else vals
        use_gdc, pdl = pdl_on(PDL, x.device)
        _chunk_topk_kernel[(R, n)](x2, vals, ids, stats, V, n, x2.stride(0), K=k, BLOCK=BLOCK, LSE=lse,
                                   USE_GDC=use_gdc, num_warps=4, **pdl)
        _merge_topk_kernel[(R,)](vals, ids, out, stats, logp if lse else vals, n * k, n, K=k,
                                 BLOCK=triton.next_power_of_2(n * k), LSE=lse, BLOCK_C=triton.next_power_of_2(n),
                                 USE_GDC=use_gdc, num_warps=4, **pdl)
    return (logp.view(*lead, k) if lse else None), out.view(*lead, k)
