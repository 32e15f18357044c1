"""Drafting with the EAGLE draft (device-only, fixed shapes).

`catch_up`: the draft reads committed pairs (x_{t+1}, h_t) of tokens and the target's hidden states, writing their
K/V to its own cache: these entries are exact history and stay. Its last output is the root's predicted feature.

`expand_tree`: level by level, each node's children are the draft's greedy top-k tokens from that node's predicted
feature (over the draft's reduced vocabulary when it has one, `eyas.spec.draft_vocab`); a level's nodes run through
the draft together, attending to the draft KV (prefix) and to their tree ancestors (suffix: stashed K/V that never
enter the cache).
"""
from __future__ import annotations

import torch

from eyas.layers.attention import MetaBuilder
from eyas.spec.draft_vocab import draft_topk
from eyas.spec.tree import Tree


def causal_mask(lens: torch.Tensor, Q: int) -> torch.Tensor:
    """[B, Q, Q]: causal among each row's first lens[b] tokens; padded rows see themselves (never an empty row)."""
    ar = torch.arange(Q, device=lens.device)
    causal = ar[None, :] <= ar[:, None]
    valid = ar[None, :] < lens[:, None]
    return (causal[None] & valid[:, None, :]) | torch.eye(Q, dtype=torch.bool, device=lens.device)[None]


def catch_up(draft, target, draft_cache, tokens, hidden, lens, start, meta: MetaBuilder):
    """Draft forward over pairs (tokens[b, j], hidden[b, j]) at positions start[b] + j, j < lens[b]; their K/V are
    written to the draft cache. Returns the draft outputs [B, P, H]."""
    B, P = tokens.shape
    ar = torch.arange(P, device=tokens.device)[None, :]
    valid = ar < lens[:, None]
    positions = torch.where(valid, start[:, None] + ar, torch.zeros_like(ar))
    m = meta(start, causal_mask(lens, P), slot_mapping=meta.slots(start[:, None] + ar, valid))
    return draft(target.embed(tokens), hidden, positions, m, draft_cache)


def expand_tree(draft, target, draft_cache, tree: Tree, root_h, n, node_tokens, meta: MetaBuilder) -> None:
    """Fill node_tokens[:, 1:] level by level from the root feature root_h [B, H]; n [B] = target KV length (the
    root's draft entry is at n-1, so a node of depth d sits at draft position n-1+d)."""
    B, H = root_h.shape
    device = root_h.device
    node_h = torch.zeros(B, tree.num_nodes + 1, H, dtype=root_h.dtype, device=device)
    node_h[:, 0] = root_h
    parents, ranks = tree.parents.to(device), tree.rank.to(device)
    ancestors = tree.ancestor_mask.to(device)
    past: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for d in range(tree.max_depth):
        level, nxt = tree.levels[d], tree.levels[d + 1]
        # the draft's candidates: greedy top-k over the vocabulary (or the draft's reduced vocabulary)
        top = draft_topk(draft, target, node_h[:, level.start: level.stop], tree.topk_per_level[d])  # [B, |level|, k]
        par = parents[nxt.start: nxt.stop] - level.start
        node_tokens[:, nxt.start: nxt.stop] = top[:, par, ranks[nxt.start: nxt.stop]]
        if d + 1 == tree.max_depth:
            break  # the deepest level needs tokens, not features
        ids = node_tokens[:, nxt.start: nxt.stop]
        h_in = node_h[:, parents[nxt.start: nxt.stop]]
        positions = (n + d)[:, None].expand(B, len(nxt))
        mask = ancestors[nxt.start: nxt.stop, 1: nxt.stop]
        m = meta(n, mask[None].expand(B, *mask.shape), stash=True, past_kv=past or None)
        node_h[:, nxt.start: nxt.stop] = draft(target.embed(ids), h_in, positions, m, draft_cache)
        past = {l: (torch.cat([past[l][0], k], 1), torch.cat([past[l][1], v], 1)) if l in past else (k, v)
                for l, (k, v) in m.new_kv.items()}
