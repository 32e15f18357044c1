"""A sampled step's acceptance rounds and walk in one Triton launch: what `eyas.spec.verifier.accept_tree_logits`
does between its two passes over the vocabulary (`eyas.kernels.race`), for CUDA.

In PyTorch ops the rounds took ~25 small kernels (the children's tokens and repeats, their logits, p = exp(x - M) / Z,
the residual masses, the uniforms, the first accepted child, a gather a depth for the walk, the stop node's
children): ~0.11 ms of a sampled step on an H100, where greedy acceptance takes one launch of ~6 us (session 59,
`tools/diag/accept_cost.py`). Here one program per sequence holds its tree as a [nodes, children] tile:

* child j of node n has the token tok = node_tokens[child]; it is worth p = exp(x_tok - M_n) / Z_n under the node's
  softmax (x = logits / t; a greedy row: 1 at the node's argmax, else 0), or 0 where an earlier sibling has the same
  token;
* round j accepts iff u_j * (1 - p_1 - ... - p_{j-1}) < p_j, u_j the uniform at index depth * (W + 1) + j (the
  same bits as `eyas.layers.sampler.uniform`);
* the walk follows each node's first accepted child from the root; it stops at the node whose children were all
  rejected, and the race for the bonus needs that node's row, its children's tokens (excluded) and its depth.

The reference is the same function in PyTorch ops (`accept_tree_logits` with `use_triton=False`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import div_rn, exp_rn, interpreting
from eyas.kernels.race import temperature_of
from eyas.kernels.uniform import hash24

BIG = tl.constexpr(2147483647)


@triton.jit
def _rounds_kernel(LOGITS, T, M, Z, TOP, NODE, CHILD, DEP, SEEDS, CNT, PATH, PACKED, EXCL, ROWS, BASE,
                   N1, V, W, race_base, stride_lb, stride_ln, stride_nb, stride_ct, stride_dt, stride_pb, stride_kb,
                   DMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PRECISE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    w = tl.arange(0, BLOCK_W)
    okn = n < N1
    okw = w < W
    ch = tl.load(CHILD + b * stride_ct + n[:, None] * W + w[None, :], mask=okn[:, None] & okw[None, :], other=-1)
    valid = ch >= 0
    tok = tl.load(NODE + b * stride_nb + tl.maximum(ch, 0), mask=valid, other=-1)
    repeat = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int1)
    for j in tl.static_range(BLOCK_W):  # an earlier sibling (column j) with the same token
        tj = tl.sum(tl.where(w[None, :] == j, tok, 0), axis=1)
        vj = tl.sum(tl.where((w[None, :] == j) & valid, 1, 0), axis=1) > 0
        repeat = repeat | ((tok == tj[:, None]) & vj[:, None] & (w[None, :] > j))
    t, greedy = temperature_of(T, b)
    row = b * N1 + n
    m = tl.load(M + row, mask=okn, other=0.0)
    z = tl.load(Z + row, mask=okn, other=1.0)
    top = tl.load(TOP + row, mask=okn, other=-1)
    lg = tl.load(LOGITS + b * stride_lb + n[:, None] * stride_ln + tl.maximum(tok, 0), mask=valid,
                 other=0.0).to(tl.float32)
    # IEEE division and libdevice's exp, as PyTorch computes them (Triton's own are approximations)
    p = div_rn(exp_rn(div_rn(lg, t, PRECISE) - m[:, None], PRECISE), z[:, None], PRECISE)
    p = tl.where(greedy, tl.where(tok == top[:, None], 1.0, 0.0), p)
    p = tl.where(valid & (~repeat), p, 0.0)
    left = 1.0 - (tl.cumsum(p, axis=1) - p)  # the residual's mass when round j begins
    dep = tl.load(DEP + b * stride_dt + n, mask=okn, other=0)
    bits = hash24(SEEDS, CNT, b, (dep[:, None] * (W + 1) + w[None, :]).to(tl.int64))
    u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # exact: a power of two
    ok = valid & (u * left < p)
    first = tl.min(tl.where(ok, w[None, :], BIG), axis=1)  # the first accepted child of each node
    step = tl.where(first < BIG, tl.sum(tl.where(w[None, :] == first[:, None], ch, 0), axis=1), -1)
    cur = tl.full([], 0, tl.int64)
    alive = tl.full([], 1, tl.int1)
    tl.store(PATH + b * stride_pb, 0)
    tl.store(PACKED + b * stride_kb + 1, tl.load(NODE + b * stride_nb))
    for d in tl.static_range(DMAX):
        nxt = tl.sum(tl.where(n == cur, step, 0), axis=0).to(tl.int64)
        alive = alive & (nxt >= 0)
        cur = tl.where(alive, nxt, cur)
        tl.store(PATH + b * stride_pb + d + 1, tl.where(alive, nxt, -1))
        # the path's tokens (the root's past the accepted depth, as the gather of the clamped path gives)
        tl.store(PACKED + b * stride_kb + d + 2, tl.load(NODE + b * stride_nb + tl.where(alive, nxt, 0)))
    at = n == cur
    d_cur = tl.sum(tl.where(at, dep, 0), axis=0).to(tl.int64)
    tl.store(PACKED + b * stride_kb, d_cur)
    stop_tok = tl.sum(tl.where(at[:, None], tl.where(valid, tok, 0), 0), axis=0)
    stop_valid = tl.sum(tl.where(at[:, None] & valid, 1, 0), axis=0) > 0
    tl.store(EXCL + b * W + w, tl.where(stop_valid, stop_tok, -1), mask=okw)
    tl.store(ROWS + b, b * N1 + cur)
    tl.store(BASE + b, race_base + V * d_cur)


def accept_rounds_triton(logits: torch.Tensor, temperature: torch.Tensor, M: torch.Tensor, Z: torch.Tensor,
                         top: torch.Tensor, node_tokens: torch.Tensor, tree, seeds: torch.Tensor,
                         counters: torch.Tensor, race_base: int):
    """logits [B, N+1, V]; temperature, seeds, counters [B]; M, Z, top [B * (N+1)] (`row_stats_triton`);
    node_tokens [B, N+1]; `tree` a static `Tree` or a step's `StepTree`. Returns (path [B, D+1], packed [B, D+3]
    (num_accepted, the path's tokens, the bonus's place: unwritten), exclude [B, W] (the stop node's children's
    tokens, -1 where none), rows [B] (the stop node's row of logits viewed [B * (N+1), V]), base [B] (its race's
    first uniform index))."""
    B, N1, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    children = tree.children.to(dev)
    depth = tree.depth.to(dev)
    per_seq = children.dim() == 3
    children, depth, node_tokens = children.contiguous(), depth.contiguous(), node_tokens.contiguous()
    W = children.shape[-1]
    D = tree.max_depth
    path = torch.empty((B, D + 1), dtype=torch.long, device=dev)
    packed = torch.empty((B, D + 3), dtype=torch.long, device=dev)
    exclude = torch.empty((B, W), dtype=torch.long, device=dev)
    rows = torch.empty(B, dtype=torch.long, device=dev)
    base = torch.empty(B, dtype=torch.long, device=dev)
    if B:
        _rounds_kernel[(B,)](
            logits, temperature.contiguous(), M, Z, top, node_tokens, children, depth, seeds.contiguous(),
            counters.contiguous(), path, packed, exclude, rows, base,
            N1, V, W, race_base, logits.stride(0), logits.stride(1), node_tokens.stride(0),
            children.stride(0) if per_seq else 0, depth.stride(0) if per_seq else 0, path.stride(0), packed.stride(0),
            DMAX=D, BLOCK_N=triton.next_power_of_2(N1), BLOCK_W=max(2, triton.next_power_of_2(W)),
            PRECISE=not interpreting(), num_warps=4)
    return path, packed, exclude, rows, base


def accept_tree_logits_triton(logits: torch.Tensor, temperature: torch.Tensor, node_tokens: torch.Tensor, tree,
                              seeds: torch.Tensor, counters: torch.Tensor):
    """`eyas.spec.verifier.accept_tree_logits` in five launches (the row statistics' two, the rounds', the race's
    two): (path [B, D+1], num_accepted [B], bonus [B], packed [B, D+3]: (num_accepted, the path's tokens, bonus), what
    the host reads; num_accepted and bonus are views of it). Plain sampled decoding (no draft token): the race alone,
    and packed None."""
    from eyas.kernels.race import race_sample_triton, row_stats_triton
    from eyas.layers.sampler import RACE_BASE
    B, N1, V = logits.shape
    t = temperature.float()
    if N1 == 1:
        none = torch.zeros(B, dtype=torch.long, device=logits.device)
        bonus = race_sample_triton(logits.view(B, V), t, seeds, counters, torch.full_like(none, RACE_BASE))
        return none[:, None], none, bonus, None
    flat = logits.reshape(B * N1, V)
    M, Z, top = row_stats_triton(flat, t.repeat_interleave(N1))
    path, packed, exclude, rows, base = accept_rounds_triton(logits, t, M, Z, top, node_tokens, tree, seeds,
                                                             counters, RACE_BASE)
    D = tree.max_depth
    race_sample_triton(flat, t, seeds, counters, base, exclude, rows, out=packed[:, D + 2])
    return path, packed[:, 0], packed[:, D + 2], packed
