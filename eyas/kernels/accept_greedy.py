"""Greedy tree acceptance in one Triton launch: `eyas.spec.verifier.accept_tree_greedy` (its reference) for CUDA.

The reference takes ~20 small PyTorch kernels (a gather, the comparison, an ancestor-mask reduction, the deepest
node, the path's nodes by depth, the bonus): ~15% of a tree step's kernels after session 6's other cuts. Here one
program per sequence does the same:

* node i matches when its token is the target's token after its parent (the root always matches);
* it is reachable when it and every ancestor match (a row of the ancestor mask, rows in chunks of RB);
* the accepted path ends at the deepest reachable node (the first such index, as `argmax`), its nodes by depth
  are that node's ancestors, and the bonus is the target's token after it.

`replay_accept_triton` is the same launch for benchmarks of random-weight models that replay a real draft's
recorded rank paths (`eyas.spec.verifier.simulate_replay`, its reference): a node matches when the row of ranks its
sequence reads starts with the node's own rank path. Without it the replay took ~20 small PyTorch kernels (~50 us
of the 8B shape's `chain:3` step, session 20's profile) where real greedy acceptance takes this one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BIG = tl.constexpr(2147483647)  # a global a @triton.jit function reads must be a constexpr


@triton.jit
def _accept_greedy_kernel(TGT, NODE, PAR, DEP, ANC, PATH, PACKED,
                          n_nodes, stride_tb, stride_nb, stride_ar, stride_pb, stride_kb, stride_tree,
                          stride_ab,
                          RANKS, SEEDS, CNT, NRANK, n_rows, n_ranks, stride_rr, stride_nr,
                          DMAX: tl.constexpr, BLOCK: tl.constexpr, RB: tl.constexpr,
                          REPLAY: tl.constexpr = False, DT: tl.constexpr = 1):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_nodes
    PAR += b * stride_tree  # a step's own trees, one per sequence (a static tree: strides 0)
    DEP += b * stride_tree
    ANC += b * stride_ab
    if REPLAY:  # node i matches when the sequence's row of recorded ranks starts with i's rank path
        x = tl.load(SEEDS + b).to(tl.int64) + tl.load(CNT + b).to(tl.int64)
        t = x % n_rows
        t = tl.where(t < 0, t + n_rows, t)  # torch.remainder's sign
        dep_i = tl.load(DEP + offs, mask=ok, other=0)
        match = ok
        for k in tl.static_range(DT):
            want = tl.load(NRANK + offs * stride_nr + k, mask=ok, other=-1)
            got = tl.load(RANKS + t * stride_rr + k, mask=k < n_ranks, other=-1)  # a shorter recording: no match
            match = match & ((got == want) | (k >= dep_i))
    else:  # node i matches when its token is the target's token after its parent
        par = tl.maximum(tl.load(PAR + offs, mask=ok, other=0), 0)
        tok = tl.load(NODE + b * stride_nb + offs, mask=ok, other=0)
        after_parent = tl.load(TGT + b * stride_tb + par, mask=ok, other=0)
        match = ((tok == after_parent) | (offs == 0)) & ok
    best_d = tl.full([], -1, tl.int64)
    best = tl.full([], 0, tl.int64)
    for r0 in range(0, n_nodes, RB):
        rows = r0 + tl.arange(0, RB)
        row_ok = rows < n_nodes
        anc = tl.load(ANC + rows[:, None] * stride_ar + offs[None, :], mask=row_ok[:, None] & ok[None, :], other=0)
        broken = (anc != 0) & (~match)[None, :]  # an ancestor (or the node itself) that does not match
        reach = (tl.max(broken.to(tl.int32), axis=1) == 0) & row_ok
        d = tl.load(DEP + rows, mask=row_ok, other=-1).to(tl.int64)
        score = tl.where(reach, d, -1)
        m = tl.max(score, axis=0)
        first = tl.min(tl.where(score == m, rows, BIG), axis=0).to(tl.int64)
        take = m > best_d  # strictly deeper: an earlier chunk keeps a tie (the first index, as argmax)
        best = tl.where(take, first, best)
        best_d = tl.maximum(best_d, m)
    on_path = tl.load(ANC + best * stride_ar + offs, mask=ok, other=0) != 0
    dep = tl.load(DEP + offs, mask=ok, other=-1)
    for d in tl.static_range(DMAX + 1):
        node = tl.min(tl.where(on_path & (dep == d), offs, BIG), axis=0)
        tl.store(PATH + b * stride_pb + d, tl.where(node == BIG, -1, node).to(tl.int64))
        # the path's tokens (the root's past the accepted depth, as the gather of the clamped path gives)
        tl.store(PACKED + b * stride_kb + 1 + d, tl.load(NODE + b * stride_nb + tl.where(node == BIG, 0, node)))
    tl.store(PACKED + b * stride_kb, best_d)
    tl.store(PACKED + b * stride_kb + DMAX + 2, tl.load(TGT + b * stride_tb + best))


def accept_tree_greedy_triton(target_tokens: torch.Tensor, node_tokens: torch.Tensor, tree) -> tuple:
    """The results of `accept_tree_greedy` for a static `Tree` or a step's dynamic trees (`eyas.spec.dynamic_tree.
    StepTree`, one per sequence) (target_tokens, node_tokens [B, N+1] -> path [B, D+1], -1 beyond the
    accepted depth; num_accepted [B]; bonus [B]), and with them the step's `packed` output [B, D+3] = (num_accepted,
    the path's tokens, bonus) that the host reads: num_accepted and bonus are views of it (int64)."""
    B, N1 = node_tokens.shape
    if target_tokens.shape != node_tokens.shape:
        raise ValueError(f"target_tokens {tuple(target_tokens.shape)} and node_tokens {tuple(node_tokens.shape)} "
                         "differ")
    return _launch(target_tokens, node_tokens, tree)


def replay_accept_triton(ranks: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                         target_tokens: torch.Tensor, node_tokens: torch.Tensor, tree) -> tuple:
    """The results of `eyas.spec.verifier.simulate_replay` (ranks [T, R] recorded rank paths; seeds, counters [B]:
    sequence b reads row (seed + counter) mod T) in one launch, with the `packed` output as
    `accept_tree_greedy_triton`'s. Benchmarks of random-weight models only."""
    B = node_tokens.shape[0]
    if ranks.dim() != 2 or ranks.shape[0] == 0 or ranks.is_floating_point():
        raise ValueError(f"ranks must be an integer tensor [T, R] with T >= 1, got {tuple(ranks.shape)}")
    if target_tokens.shape != node_tokens.shape or tuple(seeds.shape) != (B,) or tuple(counters.shape) != (B,):
        raise ValueError(f"target_tokens {tuple(target_tokens.shape)}, seeds {tuple(seeds.shape)} and counters "
                         f"{tuple(counters.shape)} do not fit node_tokens {tuple(node_tokens.shape)}")
    return _launch(target_tokens, node_tokens, tree, (ranks, seeds, counters))


def _launch(target_tokens, node_tokens, tree, replay=None):
    B, N1 = node_tokens.shape
    if N1 != tree.num_nodes + 1:
        raise ValueError(f"{N1} node columns for a tree of {tree.num_nodes} nodes and the root")
    device = node_tokens.device
    D = tree.max_depth
    path = torch.empty((B, D + 1), dtype=torch.long, device=device)
    packed = torch.empty((B, D + 3), dtype=torch.long, device=device)
    if B:
        tgt, nodes = target_tokens.contiguous(), node_tokens.contiguous()
        anc = tree.ancestor_mask.to(device)
        anc = (anc.view(torch.uint8) if anc.dtype == torch.bool else anc).contiguous()
        par, dep = tree.parents.to(device).contiguous(), tree.depth.to(device).contiguous()
        per_seq = par.dim() == 2  # a step's dynamic trees (`StepTree`: [B, N+1], [B, N+1, N+1])
        if replay is None:
            ranks = seeds = counters = nrank = path  # not read
            rep = dict(n_rows=1, n_ranks=0, stride_rr=0, stride_nr=0)
        else:
            if per_seq:
                raise ValueError("a step's dynamic trees cannot replay recorded rank paths")
            ranks, seeds, counters = (t.contiguous() for t in replay)
            nrank = tree.rank_paths.to(device).contiguous()
            rep = dict(n_rows=ranks.shape[0], n_ranks=ranks.shape[1], stride_rr=ranks.stride(0),
                       stride_nr=nrank.stride(0), REPLAY=True, DT=nrank.shape[1])
        _accept_greedy_kernel[(B,)](
            tgt, nodes, par, dep, anc, path, packed,
            N1, tgt.stride(0), nodes.stride(0), anc.stride(-2), path.stride(0), packed.stride(0),
            par.stride(0) if per_seq else 0, anc.stride(0) if per_seq else 0,
            ranks, seeds, counters, nrank, **rep,
            DMAX=D, BLOCK=max(16, triton.next_power_of_2(N1)), RB=min(32, max(16, triton.next_power_of_2(N1))),
            num_warps=4,
        )
    return path, packed[:, 0], packed[:, D + 2], packed
