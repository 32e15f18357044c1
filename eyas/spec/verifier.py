"""Acceptance: which draft tokens of a verified tree are committed, and the bonus token after them.

`accept_tree_race` is where a sampled step accepts its tokens (`eyas.spec.step.COUPLED`, on): the token plain
sampled decoding would draw after every node (`race_winners`: the exponential race at the node's position's
counter) is computed for all nodes at once, and a child is accepted iff it is that token, as greedy acceptance
(`accept_tree_greedy`) accepts the argmax. A seeded request's output is therefore plain decoding's, token for token,
whatever the tree, the draft or the batch. It is multi-round speculative sampling (below) with greedy drafting,
coupled to plain decoding's draws: at a node with distribution p, child j is accepted iff the race's winner is c_j,
with probability p(c_j), as round j's acceptance after rounds 1..j-1 rejected (r_j(c_j) (1 - p(c_1) - ... -
p(c_{j-1})) = p(c_j)); the emitted token is the winner, distributed as p. With COUPLED off, the rounds below draw
their own uniforms.

`accept_tree` is the rounds' path: it decides, for every node of every sequence at once,
which child the walk would take from there, then follows those choices from the root (a few dozen kernels for any
tree, with no host sync). `accept_tree_logits` does the same from the logits when no request filters (top-k, top-p,
min-p), without ever making the [B, N+1, V] probabilities. `accept_tree_reference` is the walk itself, one round at a
time; the others are held equal to it.

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
                counters: torch.Tensor, use_triton: bool = False, race: tuple | None = None):
    """probs [B, N+1, V] target distribution at every node; node_tokens [B, N+1] (node 0 = root, the last committed
    token); seeds, counters [B] (counter = the root's position). `tree`: a static `Tree` or a step's dynamic trees.

    Returns path [B, D+1] (accepted node indices, root first, -1 padded), num_accepted [B] (draft tokens accepted),
    bonus [B] (the token sampled after the last accepted node). `use_triton`: the uniforms in one launch
    (`eyas.kernels.uniform`, the same bits). `race` (logits [B, N+1, V], temperature [B]; probs their filtered
    softmax): the bonus is raced on the stop node's logits among the tokens its residual keeps (`race_sample`), as
    `accept_tree_logits` draws it, so that a request's tokens do not depend on whether another request in its batch
    filters; without it, the residual's inverse CDF.

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
    draws = _draws(seeds, counters, use_triton)
    if N1 == 1:  # plain sampled decoding: no rounds; the bonus, the walk's draw at index W of depth 0
        none = torch.zeros(B, dtype=torch.long, device=device)
        if race is not None:
            return none[:, None], none, _race_kept(race, probs[:, 0], none, none, seeds, counters, use_triton)
        u = draws(torch.full((B, 1), tree.children.shape[-1], dtype=torch.long, device=device))[:, 0]
        return none[:, None], none, sample_from(probs[:, 0], u)
    tok, valid, repeat, depth, children = _children(node_tokens, tree, B)
    W = children.shape[2]
    p = torch.where(valid & ~repeat, probs.gather(2, tok), 0.0)  # [B, N+1, W]
    path, cur, u = _rounds(p, probs.sum(-1, keepdim=True), valid, depth, children, tree.max_depth, draws)
    # the bonus: the stop node's distribution without its children's tokens (each was tried and rejected)
    rows = torch.arange(B, device=device)
    removed = torch.zeros(B, V + 1, dtype=torch.bool, device=device)
    removed.scatter_(1, torch.where(valid[rows, cur], tok[rows, cur], V), True)
    residual = probs[rows, cur].masked_fill(removed[:, :V], 0.0)
    if race is not None:
        return path, depth[rows, cur], _race_kept(race, residual, cur, depth[rows, cur], seeds, counters, use_triton)
    bonus = sample_from(residual, u[rows, cur, W])
    return path, depth[rows, cur], bonus


def _race_kept(race: tuple, residual: torch.Tensor, cur: torch.Tensor, depth: torch.Tensor, seeds: torch.Tensor,
               counters: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """The race at the stop nodes `cur` (depth [B]) among the tokens their residual [B, V] keeps."""
    from eyas.layers.sampler import RACE_BASE, race_for
    logits, temperature = race
    B, _, V = logits.shape
    rows = torch.arange(B, device=logits.device)
    x = logits[rows, cur].masked_fill(residual == 0, float("-inf"))
    return race_for(use_triton)(x, temperature.float(), seeds, counters, RACE_BASE + V * depth)


def accept_tree_logits(logits: torch.Tensor, temperature: torch.Tensor, node_tokens: torch.Tensor, tree: Tree,
                       seeds: torch.Tensor, counters: torch.Tensor, use_triton: bool = False,
                       filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """`accept_tree` for target distributions softmax(logits / t) with no top-k, top-p or min-p (a "sampled" step,
    `eyas.layers.sampler.sampling_mode`; rows with t <= 0 are greedy), without the [B, N+1, V] probabilities: logits
    [B, N+1, V] (any float dtype), temperature [B]; the rest and the outputs as `accept_tree`.

    The rounds need p at the children's tokens only: p_j = exp(x_j - M) / Z with x = logits / t, and each node's
    M = max x and Z = sum exp(x - M) come from one pass over the logits (`row_stats`; greedy rows: p_j = 1 at the
    argmax, else 0). The bonus is drawn from the stop node's row by an exponential race with the rejected children
    excluded (`race_sample`), so no row is ever normalised. `use_triton`: both passes and the uniforms in Triton
    (`eyas.kernels.race`, `eyas.kernels.uniform`). The reference is `accept_tree_reference` with `race`.

    `filters` (top_k, top_p, min_p [B]): the filtered softmaxes, as one threshold per node (`filter_threshold`, found
    by radix selection on the GPU: `eyas.kernels.filter_threshold`; no sort): p_j = 0 below it, Z the kept mass,
    and the race runs above it. Ties at a filter's boundary all stay, where `logits_to_probs` keeps some."""
    from eyas.layers.sampler import RACE_BASE, race_for, row_stats, threshold_for
    B, N1, V = logits.shape
    device = logits.device
    t = temperature.float()
    race = race_for(use_triton)
    flat_t = t.repeat_interleave(N1)
    tau = None
    if filters is not None:
        tau, M, Z, top = threshold_for(use_triton)(logits.view(B * N1, V), flat_t,
                                                   *(f.repeat_interleave(N1) for f in filters))
    if N1 == 1:  # plain sampled decoding: one race over the root's row
        none = torch.zeros(B, dtype=torch.long, device=device)
        base = torch.full((B,), RACE_BASE, device=device)  # depth 0's (a race at depth d: RACE_BASE + V * d)
        return none[:, None], none, race(logits.view(B, V), t, seeds, counters, base, tau=tau)
    tok, valid, repeat, depth, children = _children(node_tokens, tree, B)
    if filters is None:
        if use_triton:
            from eyas.kernels.race import row_stats_triton as row_stats
        M, Z, top = row_stats(logits.view(B * N1, V), flat_t)
    M, Z, top = M.view(B, N1, 1), Z.view(B, N1, 1), top.view(B, N1, 1)
    greedy = (t <= 0)[:, None, None]
    x = logits.gather(2, tok).float() / torch.where(greedy, 1.0, t[:, None, None])
    p = torch.where(greedy, (tok == top).float(), torch.exp(x - M) / Z)
    if tau is not None:
        p = torch.where(x >= tau.view(B, N1, 1), p, 0.0)
    p = torch.where(valid & ~repeat, p, 0.0)
    path, cur, _ = _rounds(p, torch.ones_like(M), valid, depth, children, tree.max_depth,
                           _draws(seeds, counters, use_triton))
    rows = torch.arange(B, device=device)
    exclude = torch.where(valid[rows, cur], tok[rows, cur], -1)  # the stop node's children, each tried and rejected
    base = RACE_BASE + V * depth[rows, cur]
    stop_tau = None if tau is None else tau.view(B, N1)[rows, cur]
    if use_triton:  # the Triton race reads the stop nodes' rows where they are
        bonus = race(logits.view(B * N1, V), t, seeds, counters, base, exclude, rows * N1 + cur, tau=stop_tau)
    else:
        bonus = race(logits[rows, cur], t, seeds, counters, base, exclude, tau=stop_tau)
    return path, depth[rows, cur], bonus


def race_winners(logits: torch.Tensor, temperature: torch.Tensor, tree, seeds: torch.Tensor, counters: torch.Tensor,
                 use_triton: bool = False, filters: tuple | None = None) -> torch.Tensor:
    """The token plain sampled decoding would draw after every node [B, N+1]: the exponential race on the node's
    logits at the counter of the node's position (the root's, `counters`, plus its depth) and index RACE_BASE, as
    `prefill_graph.first_tokens` and a plain step draw theirs (rows with t <= 0: the argmax). `filters` (top_k,
    top_p, min_p [B]): among the tokens at or above each node's threshold (`filter_threshold`)."""
    from eyas.layers.sampler import RACE_BASE, race_for, threshold_for
    B, N1, V = logits.shape
    depth = batched(tree, B, logits.device)[1]
    flat_t = temperature.float().repeat_interleave(N1)
    tau = None
    if filters is not None:
        tau = threshold_for(use_triton)(logits.view(B * N1, V), flat_t, *(f.repeat_interleave(N1) for f in filters))[0]
    rows_counters = (counters[:, None] + depth).reshape(-1)
    return race_for(use_triton)(logits.reshape(B * N1, V), flat_t, seeds.repeat_interleave(N1), rows_counters,
                                torch.full_like(rows_counters, RACE_BASE), tau=tau).view(B, N1)


def accept_tree_race(logits: torch.Tensor, temperature: torch.Tensor, node_tokens: torch.Tensor, tree,
                     seeds: torch.Tensor, counters: torch.Tensor, use_triton: bool = False,
                     filters: tuple | None = None):
    """Coupled acceptance: a child is accepted iff its token is the one plain sampled decoding draws after its parent
    (`race_winners`), and the bonus is the one it draws after the last accepted node. So a seeded request's output is
    plain decoding's, token for token, whatever the tree, the draft or the batch. The law is multi-round speculative
    sampling's with greedy drafting: at a node with target distribution p, child j is accepted with probability
    p(c_j) (the race's winner is c_j), and the emitted token is distributed as p."""
    winners = race_winners(logits, temperature, tree, seeds, counters, use_triton, filters)
    return accept_tree_greedy(winners, node_tokens, tree)


def _draws(seeds: torch.Tensor, counters: torch.Tensor, use_triton: bool):
    """index [B, ...] -> the uniforms at those indices of each row's (seed, counter)."""
    B = seeds.shape[0]

    def draws(index: torch.Tensor) -> torch.Tensor:
        if use_triton:
            from eyas.kernels.uniform import uniform_triton
            return uniform_triton(seeds, counters, index.reshape(B, -1)).view(index.shape)
        shape = (B,) + (1,) * (index.dim() - 1)
        return uniform(seeds.view(shape), counters.view(shape), index)
    return draws


def _children(node_tokens: torch.Tensor, tree, B: int):
    """Every node's children's tokens tok [B, N+1, W], valid (a child there), repeat (an earlier sibling has its
    token), the nodes' depths [B, N+1] and their children [B, N+1, W]."""
    _, depth, _, children = batched(tree, B, node_tokens.device)  # [B, N+1], [B, N+1, W]
    N1, W = children.shape[1], children.shape[2]
    cols = torch.arange(W, device=node_tokens.device)
    valid = children >= 0  # the walk's rounds at a node of depth d stop at topk_per_level[d]: its children are fewer
    tok = node_tokens.gather(1, children.clamp(min=0).reshape(B, N1 * W)).view(B, N1, W)
    repeat = ((tok[..., :, None] == tok[..., None, :]) & valid[..., None, :]
              & (cols[None, :] < cols[:, None])).any(-1)  # [b, n, j]: an earlier tried sibling has j's token
    return tok, valid, repeat, depth, children


def _rounds(p: torch.Tensor, total: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor, children: torch.Tensor,
            D: int, draws):
    """Every node's rounds at once (p [B, N+1, W] the children's probabilities, 0 where invalid or repeated; total
    [B, N+1, 1] each node's mass; `_children`' valid, depth and children), then the walk along the first accepted
    children, D deep: (path [B, D+1], the stop node [B], the uniforms [B, N+1, W+1])."""
    B, N1, W = p.shape
    device = p.device
    left = total - (p.cumsum(-1) - p)  # the residual's mass when round j begins
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
    return path, cur, u


def accept_tree_reference(probs: torch.Tensor, node_tokens: torch.Tensor, tree: Tree, seeds: torch.Tensor,
                          counters: torch.Tensor, race: tuple[torch.Tensor, torch.Tensor] | None = None):
    """`accept_tree` as the walk: one round at a time down the accepted path, each round on the whole residual
    distribution (depth x width rounds of several kernels each). `race` (logits [B, N+1, V], temperature [B]; probs
    their softmax, filtered or not): the bonus is raced on the stop node's logits among the tokens the residual
    keeps (`accept_tree_logits`' reference, and `accept_tree`'s with `race`), where without it the residual is
    sampled by its inverse CDF."""
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
        if race is None:
            u = uniform(seeds, counters, d * (W + 1) + W)
            drawn = sample_from(residual, u)
        else:  # among the tokens the residual keeps (the rejected ones and any the filters removed are at 0)
            from eyas.layers.sampler import RACE_BASE, race_sample
            drawn = race_sample(race[0][rows, cur].masked_fill(residual == 0, float("-inf")), race[1], seeds,
                                counters, torch.full_like(seeds, RACE_BASE + d * V))
        bonus = torch.where(stop_here, drawn, bonus)
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
