"""Acceptance: which draft tokens of a verified tree are committed, and the bonus token after them.

`accept_tree` is where a sampled step accepts its tokens: it decides, for every node of every sequence at once,
which child the walk would take from there, then follows those choices from the root (a few dozen kernels for any
tree, with no host sync). `accept_tree_reference` is the walk itself, one round at a time; the two are held equal.

Multi-round speculative sampling (SpecInfer; EAGLE's tree sampling). At the current node the target distribution is
p (after temperature, top-k, top-p). The draft proposed its children greedily, so each child c_j is a point mass
q_j = delta(c_j). Round j accepts c_j with probability min(1, r(c_j) / q_j(c_j)) = r(c_j), where r is the current
residual (initially p); on rejection the residual becomes norm(max(0, r - q_j)) = r with c_j removed, renormalised.
If every child is rejected, the next token is sampled from the final residual.

Why this is lossless: in round j, the token emitted from the remaining procedure (accept c_j, or reject and
continue) is distributed as r_j: P(emit c_j) = r_j(c_j), and for any other token x,
P(emit x) = (1 - r_j(c_j)) * r_{j+1}(x) = (1 - r_j(c_j)) * r_j(x) / (1 - r_j(c_j)) = r_j(x), by induction on the
rounds (the last "round" samples r exactly). Hence the token emitted at each node is distributed as p, whatever the
draft proposed; descending into an accepted child only changes which draft tokens are tried next, never the law of
the emitted token. Greedy decoding is the special case p = one-hot(argmax): a child is accepted iff it is the argmax,
and the residual sample is the argmax.
"""
from __future__ import annotations

import torch

from eyas.layers.sampler import sample_from, uniform
from eyas.spec.tree import Tree


def batched(tree, B: int, device):
    """(parents [B, N+1], depth [B, N+1], ancestor_mask [B, N+1, N+1], children [B, N+1, W]) of a static `Tree`
    (the same for every sequence: expanded views) or of a step's dynamic trees (`eyas.spec.dynamic_tree.StepTree`,
    one per sequence)."""
    if isinstance(tree, Tree):
        return tuple(t.to(device)[None].expand(B, *t.shape)
                     for t in (tree.parents, tree.depth, tree.ancestor_mask, tree.children))
    return tree.parents, tree.depth, tree.ancestor_mask, tree.children


def accept_tree(probs: torch.Tensor, node_tokens: torch.Tensor, tree: Tree, seeds: torch.Tensor,
                counters: torch.Tensor, use_triton: bool = False):
    """probs [B, N+1, V] target distribution at every node; node_tokens [B, N+1] (node 0 = root, the last committed
    token); seeds, counters [B] (counter = the root's position). `tree`: a static `Tree` or a step's dynamic trees.

    Returns path [B, D+1] (accepted node indices, root first, -1 padded), num_accepted [B] (draft tokens accepted),
    bonus [B] (the token sampled after the last accepted node). `use_triton`: the uniforms in one launch
    (`eyas.kernels.uniform`, the same bits).

    The rounds at a node need no vocabulary-wide work: child j's token has probability p_j under the node's
    distribution, and the residual after rounds 1..j-1 rejected their tokens has the mass total - (p_1 + ... +
    p_{j-1}) (siblings' tokens are distinct; a repeated one is worth 0, as in the walk). So round j accepts iff
    u_j * (total - p_1 - ... - p_{j-1}) < p_j, for every node at once ([B, N+1, W] tensors, the uniforms drawn
    with the walk's indices), and the walk follows the first accepted child from the root, D gathers. Only the
    bonus needs a whole distribution: the stop node's, with its children's tokens removed. The same law and the
    same draws as `accept_tree_reference`; the residual's mass is a difference here where the walk sums it, so a
    draw within float rounding of a threshold could fall the other way."""
    B, N1, V = probs.shape
    device = probs.device

    def draws(index: torch.Tensor) -> torch.Tensor:  # the uniforms at the walk's indices, index [B, ...]
        if use_triton:
            from eyas.kernels.uniform import uniform_triton
            return uniform_triton(seeds, counters, index.reshape(B, -1)).view(index.shape)
        shape = (B,) + (1,) * (index.dim() - 1)
        return uniform(seeds.view(shape), counters.view(shape), index)

    if N1 == 1:  # plain sampled decoding: no rounds; the bonus, the walk's draw at index W of depth 0
        none = torch.zeros(B, dtype=torch.long, device=device)
        u = draws(torch.full((B, 1), tree.children.shape[-1], dtype=torch.long, device=device))[:, 0]
        return none[:, None], none, sample_from(probs[:, 0], u)
    _, depth, _, children = batched(tree, B, device)  # [B, N+1], [B, N+1, W]
    W = children.shape[2]
    D = tree.max_depth
    cols = torch.arange(W, device=device)
    valid = children >= 0  # the walk's rounds at a node of depth d stop at topk_per_level[d]: its children are fewer
    tok = node_tokens.gather(1, children.clamp(min=0).reshape(B, N1 * W)).view(B, N1, W)
    repeat = ((tok[..., :, None] == tok[..., None, :]) & valid[..., None, :]
              & (cols[None, :] < cols[:, None])).any(-1)  # [b, n, j]: an earlier tried sibling has j's token
    p = torch.where(valid & ~repeat, probs.gather(2, tok), 0.0)  # [B, N+1, W]
    left = probs.sum(-1, keepdim=True) - (p.cumsum(-1) - p)  # the residual's mass when round j begins
    u = draws(depth[..., None] * (W + 1) + torch.arange(W + 1, device=device))  # [B, N+1, W+1]
    ok = valid & (u[..., :W] * left < p)
    step = torch.where(ok.any(-1), children.gather(2, ok.long().argmax(-1, keepdim=True)).squeeze(-1), -1)
    rows = torch.arange(B, device=device)
    cur = torch.zeros(B, dtype=torch.long, device=device)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    alive = torch.ones(B, dtype=torch.bool, device=device)
    for d in range(D):
        nxt = step[rows, cur]
        alive &= nxt >= 0
        cur = torch.where(alive, nxt, cur)
        path[:, d + 1] = torch.where(alive, nxt, -1)
    # the bonus: the stop node's distribution without its children's tokens (each was tried and rejected)
    removed = torch.zeros(B, V + 1, dtype=torch.bool, device=device)
    removed.scatter_(1, torch.where(valid[rows, cur], tok[rows, cur], V), True)
    residual = probs[rows, cur].masked_fill(removed[:, :V], 0.0)
    bonus = sample_from(residual, u[rows, cur, W])
    return path, depth[rows, cur], bonus


def accept_tree_reference(probs: torch.Tensor, node_tokens: torch.Tensor, tree: Tree, seeds: torch.Tensor,
                          counters: torch.Tensor):
    """`accept_tree` as the walk: one round at a time down the accepted path, each round on the whole residual
    distribution (depth x width rounds of several kernels each)."""
    B, _, V = probs.shape
    device = probs.device
    children = batched(tree, B, device)[3]
    W = children.shape[2]
    D = tree.max_depth
    rows = torch.arange(B, device=device)
    cur = torch.zeros(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    bonus = torch.zeros(B, dtype=torch.long, device=device)
    for d in range(D + 1):
        residual = probs[rows, cur].clone()  # [B, V]
        found = torch.zeros(B, dtype=torch.bool, device=device)
        nxt = cur.clone()
        for j in range(min(W, tree.topk_per_level[d]) if d < D else 0):  # no node of depth d has more children
            child = children[rows, cur, j]  # [B]
            tried = (child >= 0) & ~done & ~found
            tok = node_tokens[rows, child.clamp(min=0)]
            total = residual.sum(-1)
            p_tok = residual[rows, tok]
            u = uniform(seeds, counters, d * (W + 1) + j)
            ok = tried & (u * total < p_tok)
            found |= ok
            nxt = torch.where(ok, child, nxt)
            # rejected: remove the token from the residual (renormalisation is implicit in `total`)
            rejected = tried & ~ok
            residual[rows, tok] = torch.where(rejected, torch.zeros_like(p_tok), p_tok)
        stop_here = ~done & ~found
        u = uniform(seeds, counters, d * (W + 1) + W)
        bonus = torch.where(stop_here, sample_from(residual, u), bonus)
        done |= stop_here
        cur = torch.where(found, nxt, cur)
        if d + 1 <= D:
            path[:, d + 1] = torch.where(found, nxt, path[:, d + 1])
            num_accepted += found.long()
    return path, num_accepted, bonus


def accept_tree_greedy(target_tokens: torch.Tensor, node_tokens: torch.Tensor, tree: Tree):
    """`accept_tree` for a batch whose requests are all greedy, from the target's argmax at every node
    (target_tokens [B, N+1]) instead of full distributions: a child is accepted iff it is the target's token.

    No walk: node i matches when its token is the target's token after its parent; it is reachable when it and all
    its ancestors match; the accepted path ends at the deepest reachable node. Siblings carry distinct tokens (the
    draft's top-k), so at most one node per depth is reachable and that node is unique. A handful of kernels for any
    tree, where a walk costs depth x width steps of several kernels each (the step's largest cost on deep trees).
    On CUDA the step runs the same in one Triton launch (`eyas.kernels.accept_greedy`); this is its reference."""
    # ancestors [B, N+1, N+1]: [b, i, j] = j is i or an ancestor of i
    parents, _, ancestors, _ = batched(tree, node_tokens.shape[0], node_tokens.device)
    match = node_tokens == target_tokens.gather(1, parents.clamp(min=0))  # [B, N+1]
    match[:, 0] = True  # the root is committed already
    reachable = ~(ancestors & ~match[:, None, :]).any(-1)  # [B, N+1]
    return accept_deepest(reachable, tree, target_tokens)


def accept_deepest(ok: torch.Tensor, tree: Tree, target_tokens: torch.Tensor):
    """Accept the deepest node with ok[b, node] (at most one per depth; the root always ok): -> path [B, D+1] (the
    nodes from the root to it, root first, -1 beyond), num_accepted [B] (its depth), bonus [B] (the target's token
    after it)."""
    device = ok.device
    B = ok.shape[0]
    rows = torch.arange(B, device=device)
    _, depth, ancestors, _ = batched(tree, B, device)
    best = torch.where(ok, depth, -1).argmax(-1)  # [B]
    on_path = ancestors[rows, best]  # [B, N+1]
    at_depth = depth[:, :, None] == torch.arange(tree.max_depth + 1, device=device)[None, None, :]
    hit = on_path[:, :, None] & at_depth  # [B, N+1, D+1]
    path = torch.where(hit.any(1), hit.long().argmax(1), -1)
    return path, depth[rows, best], target_tokens[rows, best]


def simulate_accept(node_tokens: torch.Tensor, tree: Tree, accept_prob: torch.Tensor, seeds: torch.Tensor,
                    counters: torch.Tensor, target_tokens: torch.Tensor):
    """Replayed acceptance for benchmarks of random-weight models (which accept nothing): descend the tree along
    each node's best (rank-0) child, accepting depth d with probability accept_prob[d] given depth d-1 was
    accepted. The bonus is the target's greedy token. Same outputs as `accept_tree`; never used for real output."""
    B = node_tokens.shape[0]
    device = node_tokens.device
    D = tree.max_depth
    children = tree.children.to(device)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    cur = torch.zeros(B, dtype=torch.long, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    for d in range(D):
        child = children[cur, 0]
        ok = alive & (child >= 0) & (uniform(seeds, counters, 1000 + d) < accept_prob[d])
        cur = torch.where(ok, child, cur)
        path[:, d + 1] = torch.where(ok, child, path[:, d + 1])
        num_accepted += ok.long()
        alive = ok
    return path, num_accepted, target_tokens[torch.arange(B, device=device), cur]


def simulate_replay(node_tokens: torch.Tensor, tree: Tree, ranks: torch.Tensor, seeds: torch.Tensor,
                    counters: torch.Tensor, target_tokens: torch.Tensor):
    """Replayed acceptance from a real draft's recorded rank paths, for benchmarks of random-weight models: `ranks`
    [T, R] holds, for T positions of text the target wrote, the ranks of its greedy tokens among the draft's
    proposals at depths 1..R (-1: not among them; `eyas make-tree --save-eval-ranks`). A sequence at position n
    (`counters`) reads row (seed + n) mod T and accepts the deepest tree node whose rank path starts that row. Its
    position then advances by the tokens committed, so its steps read the rows a real decode would reach:
    `eyas.spec.tree_builder.replay` on the device, for any tree (`simulate_accept` follows rank-0 children only).
    The seed is the sequence's offset into the recording: `eyas bench latency` gives its sequences offsets spread
    evenly over it (`replay_seeds`), so that together they read all of it, not overlapping stretches. The bonus is
    the target's greedy token. Never used for real output."""
    B = node_tokens.shape[0]
    device = node_tokens.device
    depth = tree.depth.to(device)
    node_ranks = tree.rank_paths.to(device)  # [N+1, Dt]
    Dt = node_ranks.shape[1]
    t = torch.remainder(seeds.long() + counters.long(), ranks.shape[0])
    row = ranks[t].long()  # [B, R]
    if row.shape[1] < Dt:  # a shorter recording: its missing depths match nothing
        row = torch.cat([row, row.new_full((B, Dt - row.shape[1]), -1)], dim=1)
    row = row[:, :Dt]
    beyond = torch.arange(Dt, device=device)[None, :] >= depth[:, None]  # [N+1, Dt]: past node i's depth
    match = ((row[:, None, :] == node_ranks[None]) | beyond[None]).all(-1)  # [B, N+1]; the root always matches
    return accept_deepest(match, tree, target_tokens)  # distinct rank paths: one match per depth at most
