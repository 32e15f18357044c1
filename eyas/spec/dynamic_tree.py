"""Dynamic draft trees (EAGLE-2): each step's tree follows the draft's confidence in that context.

A static tree (`eyas.spec.tree`) verifies the same shape at every step: on average the best shape, but as wide where
the draft is sure as where it guesses. `dyn:kKdDnN` grows a tree per sequence and per step instead, as EAGLE-2 does
(and SGLang's `topk`, `num_steps`, `num_draft_tokens`):

1. The root's feature gives the draft's top-K tokens: depth 1, the first beam.
2. D-1 times: the beam's K nodes run through the draft together (their K/V to a stash, each attending to the draft
   cache and to its own ancestors among the earlier beams); each gives its top-K children, scored by the sum of the
   log-probabilities along its path (the draft's estimate of the chance that the path is accepted). The K best of
   these K x K become the next beam.
3. Of every candidate scored (K + (D-1) K^2), the N best by score are verified, with the root: N + 1 rows.

A child's score is its parent's plus a log-probability <= 0, so it never exceeds its parent's. The selection sorts
by score with ties in candidate order, and a parent is always a candidate before its children: every selected node's
parent is selected, so the N nodes form a tree. Siblings are distinct tokens (a top-K), as acceptance needs.

Everything has fixed shapes and runs on the device with no host synchronisation (CUDA graphs capture it whole). The
step's verified tree comes back as a `StepTree`: per sequence, the same fields a static `Tree` gives for all.

Acceptance is unchanged and so is exactness: which tokens are proposed depends only on the draft, never on the
target's samples, and the multi-round speculative sampling of `eyas.spec.verifier` is lossless for any proposed
children (its docstring has the argument). At temperature 0 the output equals plain decoding's.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from eyas.layers.attention import MetaBuilder, Stash
from eyas.layers.topk import topk_logp
from eyas.spec.draft_vocab import draft_logits, restrict_logits
from eyas.spec.drafter import draft_pairs

PREFIX = "dyn:"


@dataclass(frozen=True)
class DynamicTree:
    """`dyn:kKdDnN` (e.g. `dyn:k8d6n48`): top-K per expanded node, D draft levels (the verified tree's depth at
    most), N draft tokens verified. Stands where a static `Tree` does for the runner: `name`, `num_nodes`,
    `max_depth`, `to`."""

    topk: int
    depth: int
    num_nodes: int
    name: str

    @classmethod
    def parse(cls, spec: str) -> "DynamicTree":
        body = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
        m = re.fullmatch(r"k(\d+)d(\d+)n(\d+)", body)
        if m is None:
            raise ValueError(f"bad speculation {spec!r}: expected {PREFIX}kKdDnN with integers K (top-k a node), "
                             f"D (depth) and N (draft tokens verified), e.g. {PREFIX}k8d6n48")
        k, d, n = (int(x) for x in m.groups())
        if k < 1 or d < 1 or n < 1:
            raise ValueError(f"bad speculation {spec!r}: K, D and N must be >= 1")
        tree = cls(k, d, n, f"{PREFIX}k{k}d{d}n{n}")
        if n > tree.pool_size:
            raise ValueError(f"bad speculation {spec!r}: N={n} is more than the {tree.pool_size} candidates that "
                             f"K={k} and D={d} score (K + (D-1) K^2)")
        return tree

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def pool_size(self) -> int:
        return self.topk + (self.depth - 1) * self.topk * self.topk

    def to(self, device) -> "DynamicTree":
        return self


@dataclass
class StepTree:
    """One step's verified trees, one per sequence (device tensors, N1 = N + 1 rows with the root at 0, each level's
    parents before their children): what `eyas.spec.verifier` reads of a tree."""

    parents: torch.Tensor  # [B, N1] int64, the root's -1
    depth: torch.Tensor  # [B, N1] int64
    ancestor_mask: torch.Tensor  # [B, N1, N1] bool: [b, i, j] = j is i or an ancestor of i
    children: torch.Tensor  # [B, N1, K] int64: node i's children by the draft's rank, -1 where not verified
    max_depth: int

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1] - 1

    @property
    def topk_per_level(self) -> list[int]:
        return [self.children.shape[-1]] * self.max_depth


def draft_topk_logp(draft, target, h: torch.Tensor, k: int, allowed: torch.Tensor | None = None, adjust=None):
    """The draft's top-k from features h [B, ..., H]: (log-probabilities [..., k] in float32, target token ids
    [..., k]), over the draft vocabulary when one is attached (`draft_logits`); over the tokens `allowed` ([B, words]
    bitmasks, guided decoding) allows, when given (the log-probabilities renormalised over them). `adjust`: as
    `draft_topk`'s."""
    ids = getattr(draft, "vocab_ids", None)
    logits = draft_logits(draft, target, h)
    if allowed is not None:
        logits = restrict_logits(draft, logits, allowed)
    if adjust is not None:
        adjust(logits, ids)
    # on CUDA two Triton launches, where torch.topk and a float32 logsumexp over a 49k row take ~35 kernels
    logp, idx = topk_logp(logits, k)
    return logp, (idx if ids is None else ids[idx])


def expand_dynamic(draft, target, draft_cache, dyn: DynamicTree, root_h: torch.Tensor, root_tokens: torch.Tensor,
                   n: torch.Tensor, meta: MetaBuilder, root_allowed: torch.Tensor | None = None, penalties=None):
    """The step's trees from the root feature root_h [B, H] (root_tokens [B]; n [B] = target KV length: the root's
    draft entry is at n-1, a node of depth d at draft position n-1+d). `root_allowed` ([B, words] bitmasks, guided
    decoding): the root's children are drawn from the tokens the grammar allows next. `penalties`
    (`eyas.layers.penalties.Penalties`): each beam's candidates (and their scores) come from the draft's logits
    penalised as the target's will be after the beam's path. Returns (node_tokens [B, N+1], StepTree)."""
    B, H = root_h.shape
    K, D, N = dyn.topk, dyn.depth, dyn.num_nodes
    device = root_h.device
    rank_all, depth_all, eye_k, first_path = _constants(K, D, str(device))

    # the candidate pool, depth by depth: token, score and path (the pool ids of its ancestors below the root and of
    # itself, by depth, -1 below it)
    P = dyn.pool_size
    pool_score = torch.empty((B, P), dtype=torch.float32, device=device)
    pool_tok = torch.empty((B, P), dtype=torch.long, device=device)
    pool_path = torch.empty((B, P, D), dtype=torch.long, device=device)
    adjust = None
    if penalties is not None:  # the root's candidates: by the committed tokens
        no_path = torch.empty(B, 1, 0, dtype=torch.long, device=device)
        adjust = penalties.for_draft(no_path, no_path.bool())
    logp, tok = draft_topk_logp(draft, target, root_h, K, root_allowed, adjust)  # [B, K]
    pool_score[:, :K] = logp
    pool_tok[:, :K] = tok
    pool_path[:, :K] = first_path

    beam_tok, beam_score, beam_feat, beam_path = tok, logp, root_h[:, None].expand(B, K, H), first_path.expand(B, K, D)
    stash = Stash.like(draft_cache, B, 1 + (D - 1) * K) if D > 1 else None
    anc = eye_k.expand(B, K, K)  # the beam's ancestors among the stash rows 1.. (the beams so far), itself included
    positions = (n - 1)[:, None].expand(B, K)
    for d in range(1, D):  # the depth-d beam through the draft; its children are depth d+1
        pairs = draft_pairs(target, meta.use_triton, beam_tok, feats=beam_feat)
        m = meta(n, anc, stash=stash, stash_at=1 + (d - 1) * K, suffix_from=1)
        h = draft.forward_pairs(pairs, positions + d, m, draft_cache)  # [B, K, H]
        if penalties is not None:  # each beam's: by the committed tokens and its path's (depths 1..d)
            path = beam_path[:, :, :d]
            path_tok = pool_tok.gather(1, path.clamp(min=0).flatten(1)).view(B, K, d)
            adjust = penalties.for_draft(path_tok, path >= 0)
        logp, tok = draft_topk_logp(draft, target, h, K, None, adjust)  # [B, K, K]
        beam = grow_pool(beam_score, logp, tok, beam_path, h, anc, pool_score, pool_tok, pool_path,
                         K + (d - 1) * K * K, d, next_beam=d + 1 < D)
        if beam is not None:
            beam_tok, beam_score, beam_feat, beam_path, anc = beam

    node_tokens, parents, depth, ancestors, children = select_tree(
        pool_score, pool_tok, pool_path, depth_all, rank_all, root_tokens, N, K)
    return node_tokens, StepTree(parents, depth, ancestors, children, D)


def grow_pool(beam_score, logp, tok, beam_path, feat, anc, pool_score, pool_tok, pool_path, off: int, d: int,
              next_beam: bool):
    """One level of the beam: the depth-d beam's K nodes (beam_score [B, K], beam_path [B, K, D], their draft
    features feat [B, K, H] and ancestor rows anc [B, K, A] among the stash's beams) have children logp, tok
    [B, K, K] (each node's top K). Writes the K*K children's scores, tokens and paths (the parent's path, the child's
    own pool id at column d) to the pool (pool_score [B, P], pool_tok [B, P], pool_path [B, P, D]) from `off`.
    With next_beam, returns the next beam: the K best children (largest score first, ties to the earlier child) as
    (tokens [B, K], scores, their parents' features [B, K, H], paths [B, K, D], ancestor rows [B, K, A+K]); else
    None. On CUDA one Triton launch (`eyas.kernels.dyn_beam`); elsewhere, and as its reference, `grow_pool_torch`."""
    if beam_score.is_cuda:
        from eyas.kernels.dyn_beam import grow_pool_triton
        return grow_pool_triton(beam_score, logp, tok, beam_path, feat, anc, pool_score, pool_tok, pool_path, off,
                                d, next_beam)
    return grow_pool_torch(beam_score, logp, tok, beam_path, feat, anc, pool_score, pool_tok, pool_path, off, d,
                           next_beam)


def grow_pool_torch(beam_score, logp, tok, beam_path, feat, anc, pool_score, pool_tok, pool_path, off: int, d: int,
                    next_beam: bool):
    """`grow_pool` in PyTorch."""
    B, K = beam_score.shape
    D, H = pool_path.shape[-1], feat.shape[-1]
    KK = K * K
    score = (beam_score[:, :, None] + logp).flatten(1)  # [B, K*K]
    path = beam_path[:, :, None, :].expand(B, K, K, D).reshape(B, KK, D).clone()
    path[:, :, d] = off + torch.arange(KK, device=path.device)
    pool_score[:, off:off + KK] = score
    pool_tok[:, off:off + KK] = tok.flatten(1)
    pool_path[:, off:off + KK] = path
    if not next_beam:
        return None
    best = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :K]  # [B, K]
    par = best // K  # their parents within this beam
    prev = anc.gather(1, par[:, :, None].expand(B, K, anc.shape[-1]))
    eye = torch.eye(K, dtype=torch.bool, device=anc.device).expand(B, K, K)
    return (tok.flatten(1).gather(1, best), score.gather(1, best), feat.gather(1, par[:, :, None].expand(B, K, H)),
            path.gather(1, best[:, :, None].expand(B, K, D)), torch.cat([prev, eye], dim=-1))


def select_tree(score_all, tok_all, path_all, depth_all, rank_all, root_tokens, N: int, K: int):
    """The step's trees from the scored pools: score_all [B, P] float32, tok_all [B, P], path_all [B, P, D] (the
    pool ids along each candidate's path, -1 below its depth), depth_all and rank_all [P] (a candidate's depth and
    rank among its siblings), root_tokens [B]. Returns (node_tokens [B, N+1], parents, depth, ancestors [B, N+1,
    N+1], children [B, N+1, K]). On CUDA two Triton launches (`eyas.kernels.select_tree`); elsewhere, and as its
    reference, `select_tree_torch`."""
    if score_all.is_cuda:
        from eyas.kernels.select_tree import select_tree_triton
        return select_tree_triton(score_all, tok_all, path_all, depth_all, rank_all, root_tokens, N, K)
    return select_tree_torch(score_all, tok_all, path_all, depth_all, rank_all, root_tokens, N, K)


def select_tree_torch(score_all, tok_all, path_all, depth_all, rank_all, root_tokens, N: int, K: int):
    """`select_tree` in PyTorch."""
    B, D = score_all.shape[0], path_all.shape[-1]
    device = score_all.device
    # the N best candidates (ties in pool order: a parent before its children), then in pool order (topological)
    sel = torch.sort(-score_all, dim=-1, stable=True).indices[:, :N].sort(dim=-1).values  # [B, N]
    node_of = torch.zeros_like(tok_all)  # pool id -> node index, 0 (the root) where not selected
    node_of.scatter_(1, sel, torch.arange(1, N + 1, device=device).expand(B, N))
    depth_sel = depth_all[sel]  # [B, N]
    depth = torch.cat([torch.zeros((B, 1), dtype=torch.long, device=device), depth_sel], dim=1)
    node_tokens = torch.cat([root_tokens[:, None], tok_all.gather(1, sel)], dim=1)
    # the nodes on each selected candidate's path (past its depth -1, taken as node 0: the root, everyone's ancestor)
    path = path_all.gather(1, sel[:, :, None].expand(B, N, D)).flatten(1)  # [B, N*D] pool ids
    on_path = torch.where(path >= 0, node_of.gather(1, path.clamp(min=0)), 0).view(B, N, D)
    # a node's parent: the node one level up its path (depth 1: the root)
    up = on_path.gather(2, (depth_sel - 2).clamp(min=0)[:, :, None])[:, :, 0]
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=device),
                         torch.where(depth_sel > 1, up, 0)], dim=1)
    ancestors = torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=device)
    ancestors[:, :, 0] = True
    ancestors[:, 1:].scatter_(2, on_path, True)
    children = torch.full((B, N + 1, K), -1, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)[:, None]
    children[rows, parents[:, 1:], rank_all[sel]] = torch.arange(1, N + 1, device=device).expand(B, N)
    return node_tokens, parents, depth, ancestors, children


@functools.cache
def _constants(K: int, D: int, device: str):
    """The pool's ranks among siblings and depths [P], eye(K)[None] and the depth-1 candidates' paths [1, K, D]: made
    once per (K, D, device), outside any CUDA graph capture (a graph's warm-up runs the step eagerly first)."""
    rank = torch.cat([torch.arange(K)] + [torch.arange(K).repeat(K)] * (D - 1))
    depth = torch.cat([torch.ones(K, dtype=torch.long)] + [torch.full((K * K,), d + 1) for d in range(1, D)])
    path = torch.full((1, K, D), -1, dtype=torch.long)
    path[0, :, 0] = torch.arange(K)
    return rank.to(device), depth.to(device), torch.eye(K, dtype=torch.bool, device=device)[None], path.to(device)
