"""Drafting with the EAGLE draft (device-only, fixed shapes).

`catch_up`: the draft reads committed pairs (x_{t+1}, h_t) of tokens and the target's hidden states, writing their
K/V to its own cache: these entries are exact history and stay. Its last output is the root's predicted feature.

`expand_tree`: level by level, each node's children are the draft's greedy top-k tokens from that node's predicted
feature (over the draft's reduced vocabulary when it has one, `eyas.spec.draft_vocab`); a level's nodes run through
the draft together, attending to the draft KV (prefix) and to their tree ancestors (suffix: stashed K/V that never
enter the cache).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from eyas.layers.attention import MetaBuilder, Stash
from eyas.spec.draft_vocab import draft_topk
from eyas.spec.tree import Tree


def causal_mask(lens: torch.Tensor, Q: int) -> torch.Tensor:
    """[B, Q, Q]: causal among each row's first lens[b] tokens (lens <= Q); padded rows see themselves (never an
    empty row). For a decode step's catch-up (Q small): one lookup in a table of the Q + 1 masks, made once per
    (Q, device)."""
    if Q > 64:  # prefill chunks: computed (a table would hold Q^3 entries)
        return _causal_masks(lens, Q)
    return _causal_table(Q, str(lens.device))[lens.clamp(0, Q)]


@functools.cache
def _causal_table(Q: int, device: str) -> torch.Tensor:
    return _causal_masks(torch.arange(Q + 1, device=device), Q)


def _causal_masks(lens: torch.Tensor, Q: int) -> torch.Tensor:
    ar = torch.arange(Q, device=lens.device)
    causal = ar[None, :] <= ar[:, None]
    valid = ar[None, :] < lens[:, None]
    return (causal[None] & valid[:, None, :]) | torch.eye(Q, dtype=torch.bool, device=lens.device)[None]


def draft_pairs(target, use_triton: bool, tokens, tok_idx=None, feats=None, feat_idx=None, feat_rows=None,
                tok_out=None, pairs: bool = True):
    """The draft's input pairs cat(embed(token), feature) [B, Q, 2H] (and the tokens into `tok_out`), as
    `eyas.kernels.draft_pairs` defines them: one Triton launch when `use_triton`, `draft_pairs_reference` otherwise.
    A tensor-parallel target's embedding (vocabulary shards, all-reduced) is not a plain table: the reference
    calls the module itself."""
    emb = target.model.embed_tokens
    if use_triton and type(emb) is nn.Embedding:
        from eyas.kernels.draft_pairs import draft_pairs_triton
        return draft_pairs_triton(emb.weight, tokens, tok_idx, feats, feat_idx, feat_rows, tok_out, pairs)
    table = emb.weight if type(emb) is nn.Embedding else emb
    return draft_pairs_reference(table, tokens, tok_idx, feats, feat_idx, feat_rows, tok_out, pairs)


def check_pairs(embed, tokens, tok_idx, feats, feat_idx, feat_rows, tok_out, pairs):
    """The shapes `draft_pairs` needs (see `eyas.kernels.draft_pairs` for the arguments); returns (B, Q)."""
    B = tokens.shape[0]
    Q = tokens.shape[1] if tok_idx is None else tok_idx.shape[0]
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, T], got {tuple(tokens.shape)}")
    if tok_out is not None and tuple(tok_out.shape) != (B, Q):
        raise ValueError(f"tok_out {tuple(tok_out.shape)} must be [B={B}, Q={Q}]")
    if pairs:
        H = (embed.weight if isinstance(embed, nn.Module) else embed).shape[-1]
        if (not isinstance(embed, nn.Module) and embed.dim() != 2) or feats.dim() != 3 or feats.shape[-1] != H:
            raise ValueError(f"embed [V, H] {tuple(embed.shape)} and feats [F, R, H] {tuple(feats.shape)} do not fit")
        if feat_rows is None and feats.shape[0] != B:
            raise ValueError(f"feats has {feats.shape[0]} rows for {B} sequences and no feat_rows")
        if feat_idx is not None and feat_idx.shape[0] != Q:
            raise ValueError(f"feat_idx has {feat_idx.shape[0]} entries for {Q} rows")
    return B, Q


def draft_pairs_reference(embed, tokens, tok_idx=None, feats=None, feat_idx=None, feat_rows=None, tok_out=None,
                          pairs: bool = True):
    """`eyas.kernels.draft_pairs.draft_pairs_triton` in PyTorch: tokens[b, tok_idx[q]] (into `tok_out`), and
    cat(embed[token], feats[feat_rows[b], feat_idx[q]]) (None: the identity). `embed` may also be an embedding
    module, which is then called (a tensor-parallel target's vocabulary shards)."""
    B, Q = check_pairs(embed, tokens, tok_idx, feats, feat_idx, feat_rows, tok_out, pairs)
    ids = tokens[:, :Q] if tok_idx is None else tokens[:, tok_idx]
    if tok_out is not None:
        tok_out.copy_(ids)
    if not pairs:
        return None
    f = feats if feat_rows is None else feats[feat_rows]
    f = f[:, :Q] if feat_idx is None else f[:, feat_idx]
    e = embed(ids) if isinstance(embed, nn.Module) else embed[ids]
    return torch.cat([e, f.to(e.dtype)], dim=-1)


# The catch-up on the draft's few-rows path (`eyas.models.one_row.forward_draft_rows`, the tile kernels), as a tree
# level runs: its pairs' K/V go to a stash, they attend among themselves under the causal mask as a chain of stash
# rows, and one launch then copies the stash rows to their cache slots (`commit_tree_kv_triton`). Otherwise the
# catch-up takes the fused path (cuBLAS, and RoPE, the K/V write, the norm and SwiGLU as launches of their own: 38 us
# from its pairs to its down projection's end in session 39's profile of the default tree's step, where a tree
# level's took 29-31 us on the tiles). On since session 40: on the real SmolLM2 (MT-Bench 80 x 128, batch 1, H200,
# processes alternated) the default tree's step 1.053-1.069 ms against main's 1.078-1.084, `chain:3`'s 0.789-0.798
# against 0.814-0.817; with the draft's PDL switches on too (`eyas.kernels.chunk_topk.PDL`), 1.055-1.067 and
# 0.786-0.792 (`docs/benchmarks.md`, "Session 40").
CATCHUP_ROWS = True


def catch_up(draft, target, draft_cache, tokens, hidden, lens, start, meta: MetaBuilder, positions=None,
             slots=None, hidden_rows=None, mask=None):
    """Draft forward over pairs (tokens[b, j], hidden[b, j]) at positions start[b] + j, j < lens[b]; their K/V are
    written to the draft cache. Returns the draft outputs [B, P, H]. `positions` and `slots` [B, P] (0 and -1 past
    lens[b]), when the caller has them (the runner packs them on the host), save computing them here.
    `hidden_rows` [B]: `hidden` is a larger buffer and sequence b reads its row hidden_rows[b] (no gather first).
    `mask` [B, P, P]: `causal_mask(lens, P)`, when the caller has made it (`eyas.kernels.spec_prologue`)."""
    B, P = tokens.shape
    if positions is None or slots is None:
        ar = torch.arange(P, device=tokens.device)[None, :]
        valid = ar < lens[:, None]
        positions = torch.where(valid, start[:, None] + ar, torch.zeros_like(ar))
        slots = meta.slots(start[:, None] + ar, valid)
    if mask is None:
        mask = causal_mask(lens, P)
    pairs = draft_pairs(target, meta.use_triton, tokens, feats=hidden, feat_rows=hidden_rows)
    if CATCHUP_ROWS and getattr(draft, "few_rows", False) and meta.use_triton:
        from eyas.models.one_row import takes_draft_rows
        stash = Stash.like(draft_cache, B, P)
        m = meta(start, mask, stash=stash)
        if takes_draft_rows(draft, pairs, m):
            from eyas.kernels import commit_tree_kv_triton
            out = draft.forward_pairs(pairs, positions, m, draft_cache)
            rows = _chain_rows(P, str(tokens.device)).expand(B, P)  # stash row j -> slot j (-1 past lens: skipped)
            commit_tree_kv_triton(draft_cache.k, draft_cache.v, stash.k, stash.v, rows, slots)
            return out
    return draft.forward_pairs(pairs, positions, meta(start, mask, slot_mapping=slots), draft_cache)


@functools.cache
def _chain_rows(P: int, device: str) -> torch.Tensor:
    return torch.arange(P, device=device)[None, :]


def expand_tree(draft, target, draft_cache, tree: Tree, root_h, n, node_tokens, meta: MetaBuilder,
                draft_positions, node_h=None, root_allowed=None, penalties=None) -> None:
    """Fill node_tokens[:, 1:] level by level from the root feature root_h [B, H]; n [B] = target KV length (the
    root's draft entry is at n-1, so a node of depth d sits at draft position n-1+d: `draft_positions` [B, N+1]).
    The levels' K/V go to a stash (row = node), and each level's suffix attends to rows 1.. of it: the ancestors it
    needs, no concatenation. `node_h` [B, N+1, H]: the nodes' feature buffer, when the caller has written root_h
    to its row 0 (then root_h is that row). `root_allowed` [B, words] (guided decoding: the token bitmasks of what
    may follow each row's committed tokens): the root's children are drawn from the tokens it allows; deeper levels
    propose freely (their grammar states are only known once the tree's tokens are on the host). `penalties`
    (`eyas.layers.penalties.Penalties`): each node's children are proposed from the draft's logits penalised as the
    target's will be after that node's path (the committed tokens, then the nodes from the root's child down to
    it), so that the draft proposes what the penalised target is likely to accept."""
    B, H = root_h.shape
    device = root_h.device
    if node_h is None:
        node_h = torch.empty(B, tree.num_nodes + 1, H, dtype=root_h.dtype, device=device)
        node_h[:, 0] = root_h
    idx = tree.level_index(device)
    ancestors = tree.ancestor_mask.to(device)
    stash = Stash.like(draft_cache, B, tree.num_nodes + 1) if tree.max_depth > 1 else None
    for d in range(tree.max_depth):
        level, nxt = tree.levels[d], tree.levels[d + 1]
        pick, par_abs = idx[d]  # each child's entry in its level's flat [parent, rank] top-k, its parent's node id
        # the draft's candidates: greedy top-k over the vocabulary (or the draft's reduced vocabulary)
        adjust = None
        if penalties is not None:  # the level's nodes' paths run through nodes 1..level.stop - 1
            adjust = penalties.for_draft(node_tokens[:, 1: level.stop], ancestors[level.start: level.stop, 1: level.stop])
        top = draft_topk(draft, target, node_h[:, level.start: level.stop], tree.topk_per_level[d],  # [B, |level|, k]
                         root_allowed if d == 0 else None, adjust)
        # the children's tokens into node_tokens, and their pairs (token, parent's feature) for the draft
        last = d + 1 == tree.max_depth  # the deepest level needs tokens, not features
        pairs = draft_pairs(target, meta.use_triton, top.flatten(1), pick, node_h, par_abs,
                            tok_out=node_tokens[:, nxt.start: nxt.stop], pairs=not last)
        if last:
            break
        positions = draft_positions[:, nxt.start: nxt.stop]  # all n-1+(d+1)
        mask = ancestors[nxt.start: nxt.stop, 1: nxt.stop]
        m = meta(n, mask[None].expand(B, *mask.shape), stash=stash, stash_at=nxt.start, suffix_from=1)
        draft.forward_pairs(pairs, positions, m, draft_cache, out=node_h[:, nxt.start: nxt.stop])
