"""A dynamic tree's verified nodes and their tree in two Triton launches (`dyn:kKdDnN`, `eyas.spec.dynamic_tree`).

After the draft's levels, each sequence holds a pool of P scored candidates. The N best by score (ties in pool order)
become the step's tree: their tokens, parents, depths, ancestor masks and children by rank. In PyTorch that is a
stable sort of the scores and ~45 small kernels (~110 us a step on the H200 for `dyn:k8d5n48`, session 29). Here a
program per sequence:

1. ranks every candidate against all others (how many score higher, or equal and earlier in the pool): the N with
   rank < N are selected, as the stable sort would select them (this pass alone has a program per block of
   candidates: in one program it took 32 us of the 1.32 ms step on the H200);
2. numbers the selected in pool order (a running cumulative sum): node 1..N, topological since a parent is always
   in the pool before its children;
3. writes each node's token, depth and parent (the node one level up its path), its ancestor-mask row (every node
   on its path, and the root) and its entry among its parent's children (at its rank among siblings).

The pool-id -> node map lives in a scratch row per sequence, written and read by the same program between barriers.
The reference is `eyas.spec.dynamic_tree.select_tree_torch`; `tests/test_dynamic_tree.py` holds the two equal.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rank_kernel(SCORE, NODE_OF, P, N, BI: tl.constexpr, BJ: tl.constexpr):
    """1. Program (b, block of BI candidates): selected = fewer than N candidates beat it (a higher score, or an equal
    one earlier in the pool). Writes 1 / 0 to NODE_OF."""
    b = tl.program_id(0).to(tl.int64)
    oi = tl.program_id(1) * BI + tl.arange(0, BI)
    oki = oi < P
    si = tl.load(SCORE + b * P + oi, mask=oki, other=float("-inf"))
    cnt = tl.zeros([BI], dtype=tl.int32)
    for j0 in range(0, P, BJ):
        oj = j0 + tl.arange(0, BJ)
        sj = tl.load(SCORE + b * P + oj, mask=oj < P, other=float("-inf"))
        beats = (sj[None, :] > si[:, None]) | ((sj[None, :] == si[:, None]) & (oj[None, :] < oi[:, None]))
        beats = beats & (oj < P)[None, :]
        cnt += tl.sum(beats.to(tl.int32), axis=1)
    tl.store(NODE_OF + b * P + oi, (cnt < N).to(tl.int32), mask=oki)


@triton.jit
def _build_tree_kernel(TOK, PATH, DEPTH_ALL, RANK_ALL, ROOT, NODE_OF, NODE_TOK, PARENTS, DEPTH, ANC, CHILDREN,
                       P, N, D, K, BI: tl.constexpr, BD: tl.constexpr, BA: tl.constexpr):
    """2-3. Program b: numbers its selected candidates and writes its tree."""
    b = tl.program_id(0).to(tl.int64)
    N1 = N + 1
    # this sequence's ancestor masks cleared, its children lists emptied
    for a0 in range(0, N1 * N1, BA):
        oa = a0 + tl.arange(0, BA)
        tl.store(ANC + b * N1 * N1 + oa, tl.zeros([BA], dtype=tl.int8), mask=oa < N1 * N1)
    for a0 in range(0, N1 * K, BA):
        oa = a0 + tl.arange(0, BA)
        tl.store(CHILDREN + b * N1 * K + oa, tl.full([BA], -1, dtype=tl.int64), mask=oa < N1 * K)
    # 2. the selected numbered 1..N in pool order
    run = 0
    for i0 in range(0, P, BI):
        oi = i0 + tl.arange(0, BI)
        oki = oi < P
        f = tl.load(NODE_OF + b * P + oi, mask=oki, other=0)
        c = tl.cumsum(f, axis=0)
        tl.store(NODE_OF + b * P + oi, tl.where(f > 0, run + c, 0), mask=oki)
        run += tl.sum(f, axis=0)
    tl.debug_barrier()
    # 3. the root, then every node: token, depth, parent, ancestors, its place among its parent's children
    tl.store(NODE_TOK + b * N1, tl.load(ROOT + b))
    tl.store(PARENTS + b * N1, -1)
    tl.store(DEPTH + b * N1, 0)
    tl.store(ANC + b * N1 * N1, 1)
    od = tl.arange(0, BD)
    for i0 in range(0, P, BI):
        oi = i0 + tl.arange(0, BI)
        oki = oi < P
        node = tl.load(NODE_OF + b * P + oi, mask=oki, other=0).to(tl.int64)
        sel = oki & (node > 0)
        dep = tl.load(DEPTH_ALL + oi, mask=oki, other=1)
        tl.store(NODE_TOK + b * N1 + node, tl.load(TOK + b * P + oi, mask=sel, other=0), mask=sel)
        tl.store(DEPTH + b * N1 + node, dep, mask=sel)
        on = sel[:, None] & (od < D)[None, :]
        pth = tl.load(PATH + (b * P + oi[:, None]) * D + od[None, :], mask=on, other=-1)  # pool ids on its path
        hit = on & (pth >= 0)
        pn = tl.load(NODE_OF + b * P + pth, mask=hit, other=0).to(tl.int64)  # their node ids
        parent = tl.sum(tl.where(od[None, :] == dep[:, None] - 2, pn, 0), axis=1)  # 0 (the root) at depth 1
        tl.store(PARENTS + b * N1 + node, parent, mask=sel)
        row = ANC + (b * N1 + node) * N1
        tl.store(row[:, None] + pn, tl.full([BI, BD], 1, dtype=tl.int8), mask=hit)
        tl.store(row, tl.full([BI], 1, dtype=tl.int8), mask=sel)
        rank = tl.load(RANK_ALL + oi, mask=oki, other=0)
        tl.store(CHILDREN + (b * N1 + parent) * K + rank, node, mask=sel)


def select_tree_triton(score: torch.Tensor, tok: torch.Tensor, path: torch.Tensor, depth_all: torch.Tensor,
                       rank_all: torch.Tensor, root_tokens: torch.Tensor, N: int, K: int):
    """score [B, P] float32, tok [B, P] and path [B, P, D] int64 (pool ids, -1 below a candidate's depth),
    depth_all and rank_all [P] int64, root_tokens [B] -> (node_tokens [B, N+1], parents [B, N+1], depth [B, N+1],
    ancestors [B, N+1, N+1] bool, children [B, N+1, K]), as `select_tree_torch` gives them."""
    B, P = score.shape
    D = path.shape[-1]
    dev = score.device
    N1 = N + 1
    node_tok = torch.empty((B, N1), dtype=torch.long, device=dev)
    parents = torch.empty((B, N1), dtype=torch.long, device=dev)
    depth = torch.empty((B, N1), dtype=torch.long, device=dev)
    anc = torch.empty((B, N1, N1), dtype=torch.bool, device=dev)
    children = torch.empty((B, N1, K), dtype=torch.long, device=dev)
    node_of = torch.empty((B, P), dtype=torch.int32, device=dev)
    if B > 0:
        _rank_kernel[(B, triton.cdiv(P, 32))](score.contiguous(), node_of, P, N, BI=32, BJ=256, num_warps=4)
        _build_tree_kernel[(B,)](tok.contiguous(), path.contiguous(), depth_all, rank_all, root_tokens.contiguous(),
                                 node_of, node_tok, parents, depth, anc.view(torch.int8), children, P, N, D, K,
                                 BI=128, BD=triton.next_power_of_2(D), BA=1024, num_warps=4)
    return node_tok, parents, depth, anc, children
