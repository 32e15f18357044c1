"""One level of a dynamic tree's beam in one Triton launch (`dyn:kKdDnN`, `eyas.spec.dynamic_tree.grow_pool`).

After the draft ran the depth-d beam (K nodes) and took each node's top-K children, a level in PyTorch scores the
K x K children, appends them to the candidate pool, takes the K best as the next beam and gathers the beam's tokens,
scores, features, paths and ancestor rows: ~12 small kernels, ~25 us a level on the H200 (session 29). Here one
program per sequence does all of it:

- the children's scores (the parent's score plus the child's log-probability), tokens and paths (the parent's path
  with the child's own pool id at column d) go to the pool at offset `off`;
- with NEXT, the K best children (largest first; among equal scores the earlier child, as a stable sort) become the
  next beam: token, score, path, the parent's draft feature, and its ancestor row among the stash's beams extended
  by the K new beam rows (each its own).

The reference is `eyas.spec.dynamic_tree.grow_pool_torch`; `tests/test_dynamic_tree.py` holds the two equal.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grow_pool_kernel(BSCORE, LOGP, TOK, BPATH, FEAT, ANC, PSCORE, PTOK, PPATH, NTOK, NSCORE, NFEAT, NPATH, NANC,
                      P, off, d, D, Hd, A, s_bpath, s_anc,
                      K: tl.constexpr, BKK: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BA: tl.constexpr,
                      NEXT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BKK)
    okc = c < K * K
    par = c // K
    s = tl.load(BSCORE + b * K + par, mask=okc, other=0.0) + tl.load(LOGP + b * K * K + c, mask=okc, other=0.0)
    t = tl.load(TOK + b * K * K + c, mask=okc, other=0)
    tl.store(PSCORE + b * P + off + c, s, mask=okc)
    tl.store(PTOK + b * P + off + c, t, mask=okc)
    od = tl.arange(0, BD)
    okd = od < D
    m2 = okc[:, None] & okd[None, :]
    bp = tl.load(BPATH + b * s_bpath + par[:, None] * D + od[None, :], mask=m2, other=-1)  # -1 past the parent
    pth = tl.where(od[None, :] == d, (off + c)[:, None].to(tl.int64), bp)
    tl.store(PPATH + (b * P + off + c[:, None]) * D + od[None, :], pth, mask=m2)
    if NEXT:
        sm = tl.where(okc, s, float("-inf"))
        ok = okc
        oh = tl.arange(0, BH)
        oa = tl.arange(0, BA)
        for j in tl.static_range(K):
            m = tl.max(sm, axis=0)
            idx = tl.min(tl.where((sm == m) & ok, c, BKK), axis=0)  # the first of the best
            p = idx // K
            tl.store(NSCORE + b * K + j, m)
            tl.store(NTOK + b * K + j, tl.load(TOK + b * K * K + idx))
            prow = tl.load(BPATH + b * s_bpath + p * D + od, mask=okd, other=-1)
            tl.store(NPATH + (b * K + j) * D + od, tl.where(od == d, off + idx, prow), mask=okd)
            for h0 in range(0, Hd, BH):
                oh2 = h0 + oh
                f = tl.load(FEAT + (b * K + p) * Hd + oh2, mask=oh2 < Hd)
                tl.store(NFEAT + (b * K + j) * Hd + oh2, f, mask=oh2 < Hd)
            # the ancestor row: the parent's among the stash's beams so far, then the new beam (itself alone)
            arow = tl.load(ANC + b * s_anc + p * A + oa, mask=oa < A, other=0)
            new = tl.where(oa < A, arow, (oa - A == j).to(tl.int8))
            tl.store(NANC + (b * K + j) * (A + K) + oa, new, mask=oa < A + K)
            sm = tl.where(c == idx, float("-inf"), sm)
            ok = ok & (c != idx)


def grow_pool_triton(beam_score, logp, tok, beam_path, feat, anc, pool_score, pool_tok, pool_path, off: int, d: int,
                     next_beam: bool):
    """`eyas.spec.dynamic_tree.grow_pool` on CUDA (its docstring has the arguments)."""
    B, K = beam_score.shape
    P, D = pool_path.shape[1], pool_path.shape[2]
    Hd, A = feat.shape[-1], anc.shape[-1]
    dev = beam_score.device
    feat = feat.contiguous()
    if beam_path.stride(2) != 1 or beam_path.stride(1) != D:
        beam_path = beam_path.contiguous()
    if anc.stride(2) != 1 or anc.stride(1) != A:
        anc = anc.contiguous()
    if next_beam:
        out = (torch.empty((B, K), dtype=tok.dtype, device=dev), torch.empty((B, K), dtype=torch.float32, device=dev),
               torch.empty((B, K, Hd), dtype=feat.dtype, device=dev),
               torch.empty((B, K, D), dtype=torch.long, device=dev),
               torch.empty((B, K, A + K), dtype=torch.bool, device=dev))
    else:
        out = (pool_tok,) * 2 + (feat, beam_path, anc)  # not written (NEXT is off)
    if B > 0:
        _grow_pool_kernel[(B,)](beam_score.contiguous(), logp.contiguous(), tok.contiguous(), beam_path, feat,
                                anc.view(torch.int8), pool_score, pool_tok, pool_path, out[0], out[1], out[2], out[3],
                                out[4].view(torch.int8), P, off, d, D, Hd, A, beam_path.stride(0), anc.stride(0),
                                K=K, BKK=triton.next_power_of_2(K * K), BD=triton.next_power_of_2(D),
                                BH=min(1024, triton.next_power_of_2(Hd)), BA=triton.next_power_of_2(A + K),
                                NEXT=next_beam, num_warps=4)
    return out if next_beam else None
