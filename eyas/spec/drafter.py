"""Drafting: the EAGLE draft expands the speculation tree level by level (one batched draft forward per level).

First the draft catches up on the committed history it has not read: pairs (x_{t+1}, h_t) of committed tokens and
the target's hidden states, written to the draft KV cache (these entries are exact history, so they stay). Its last
output is the root's predicted feature. Then, level by level, each node's children are the draft's greedy top-k
tokens from that node's predicted feature; a level's nodes run through the draft together, attending to the draft
KV (prefix) and to their tree ancestors (suffix, stashed K/V that never enter the cache).
"""
from __future__ import annotations

import torch

from eyas.spec.tree import Tree


@torch.inference_mode()
def draft_tree(draft, target, draft_cache, tree: Tree, batch, node_tokens: torch.Tensor) -> None:
    """Fill node_tokens[:, 1:] with draft tokens. Advances each sequence's draft cache to its target length."""
    from eyas.engine.runner import causal_block_mask, padded

    seqs, device = batch.seqs, batch.device
    B = len(seqs)
    # 1. catch-up: pairs (token at t+1, target hidden at t) for t = num_draft_cached .. num_cached-1
    lens = [s.num_cached - s.num_draft_cached for s in seqs]
    P = max(lens)
    toks, valid = padded([s.token_ids[s.num_draft_cached + 1: s.num_cached + 1] for s in seqs], P)
    H = target.config.hidden_size
    feats = torch.zeros(B, P, H, dtype=seqs[0].pending_hidden.dtype, device=device)
    for i, s in enumerate(seqs):
        feats[i, : lens[i]] = s.pending_hidden
    start = torch.tensor([s.num_draft_cached for s in seqs])[:, None]
    positions = start + torch.arange(P)[None, :]
    meta = batch.meta([s.num_draft_cached for s in seqs], causal_block_mask(lens, P),
                      slot_mapping=batch.slots(positions, valid))
    pos_dev = torch.where(valid, positions, torch.zeros_like(positions)).to(device)
    out = draft(target.embed(toks.to(device)), feats, pos_dev, meta, draft_cache)
    rows = torch.arange(B, device=device)
    root_h = out[rows, torch.tensor(lens, device=device) - 1]
    for s in seqs:
        s.num_draft_cached = s.num_cached
        s.pending_hidden = None

    # 2. tree levels
    n = torch.tensor([s.num_cached for s in seqs], device=device)
    node_h = torch.zeros(B, tree.num_nodes + 1, H, dtype=root_h.dtype, device=device)
    node_h[:, 0] = root_h
    parents, ranks = tree.parents.to(device), tree.rank.to(device)
    past: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for d in range(tree.max_depth):
        level, nxt = tree.levels[d], tree.levels[d + 1]
        logits = target.compute_logits(node_h[:, level.start: level.stop])
        top = logits.topk(tree.topk_per_level[d], dim=-1).indices  # [B, |level|, k]
        par = parents[nxt.start: nxt.stop] - level.start
        node_tokens[:, nxt.start: nxt.stop] = top[:, par, ranks[nxt.start: nxt.stop]]
        if d + 1 == tree.max_depth:
            break  # the deepest level needs tokens, not features
        ids = node_tokens[:, nxt.start: nxt.stop]
        h_in = node_h[:, parents[nxt.start: nxt.stop]]
        positions = (n - 1 + d + 1)[:, None].expand(B, len(nxt))
        mask = tree.ancestor_mask[nxt.start: nxt.stop, 1: nxt.stop]
        meta = batch.meta([s.num_cached for s in seqs], mask[None].expand(B, *mask.shape), stash=True,
                          past_kv=past or None)
        node_h[:, nxt.start: nxt.stop] = draft(target.embed(ids), h_in, positions, meta, draft_cache)
        past = {l: (torch.cat([past[l][0], k], 1), torch.cat([past[l][1], v], 1)) if l in past else (k, v)
                for l, (k, v) in meta.new_kv.items()}
