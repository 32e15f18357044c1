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
from eyas.layers.topk import topk_indices
from eyas.spec.draft_vocab import draft_logits
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


def draft_topk_logp(draft, target, h: torch.Tensor, k: int):
    """The draft's top-k from features h [..., H]: (log-probabilities [..., k] in float32, target token ids [..., k]),
    over the draft vocabulary when one is attached (`draft_logits`)."""
    logits = draft_logits(draft, target, h)
    idx = topk_indices(logits, k)  # on CUDA two Triton launches, where torch.topk over a 49k row takes ~20 kernels
    val = logits.gather(-1, idx).float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    ids = getattr(draft, "vocab_ids", None)
    return val.clamp(max=0.0), (idx if ids is None else ids[idx])


def expand_dynamic(draft, target, draft_cache, dyn: DynamicTree, root_h: torch.Tensor, root_tokens: torch.Tensor,
                   n: torch.Tensor, meta: MetaBuilder):
    """The step's trees from the root feature root_h [B, H] (root_tokens [B]; n [B] = target KV length: the root's
    draft entry is at n-1, a node of depth d at draft position n-1+d). Returns (node_tokens [B, N+1], StepTree)."""
    B, H = root_h.shape
    K, D, N = dyn.topk, dyn.depth, dyn.num_nodes
    device = root_h.device
    rank_all, depth_all, eye_k, first_path, child_ids, at_depth = _constants(K, D, str(device))

    # the candidate pool, depth by depth: token, score and path (the pool ids of its ancestors below the root and of
    # itself, by depth, -1 below it)
    logp, tok = draft_topk_logp(draft, target, root_h, K)  # [B, K]
    pool_tok, pool_score = [tok], [logp]
    pool_path = [first_path.expand(B, K, D)]

    beam_tok, beam_score, beam_feat, beam_path = tok, logp, root_h[:, None].expand(B, K, H), pool_path[0]
    stash = Stash.like(draft_cache, B, 1 + (D - 1) * K) if D > 1 else None
    anc = eye_k.expand(B, K, K)  # the beam's ancestors among the stash rows 1.. (the beams so far), itself included
    positions = (n - 1)[:, None].expand(B, K)
    for d in range(1, D):  # the depth-d beam through the draft; its children are depth d+1
        pairs = draft_pairs(target, meta.use_triton, beam_tok, feats=beam_feat)
        m = meta(n, anc, stash=stash, stash_at=1 + (d - 1) * K, suffix_from=1)
        h = draft.forward_pairs(pairs, positions + d, m, draft_cache)  # [B, K, H]
        logp, tok = draft_topk_logp(draft, target, h, K)  # [B, K, K]
        score = (beam_score[:, :, None] + logp).flatten(1)  # [B, K*K]
        path = torch.where(at_depth[d], child_ids[d - 1][:, None],  # the beam's paths, and the children's pool ids
                           beam_path[:, :, None, :].expand(B, K, K, D).reshape(B, K * K, D))
        pool_tok.append(tok.flatten(1))
        pool_score.append(score)
        pool_path.append(path)
        if d + 1 < D:  # the next beam: the K best children
            best = topk_indices(score, K)  # [B, K]
            par = best // K  # their parents within this beam
            beam_tok = tok.flatten(1).gather(1, best)
            beam_score = score.gather(1, best)
            beam_feat = h.gather(1, par[:, :, None].expand(B, K, H))
            beam_path = path.gather(1, best[:, :, None].expand(B, K, D))
            prev = anc.gather(1, par[:, :, None].expand(B, K, anc.shape[-1]))
            anc = torch.cat([prev, eye_k.expand(B, K, K)], dim=-1)

    tok_all, score_all = torch.cat(pool_tok, 1), torch.cat(pool_score, 1)  # [B, P]
    path_all = torch.cat(pool_path, 1)  # [B, P, D]

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
    return node_tokens, StepTree(parents, depth, ancestors, children, D)


@functools.cache
def _constants(K: int, D: int, device: str):
    """The pool's ranks among siblings and depths [P], eye(K)[None], the depth-1 candidates' paths [1, K, D], each
    deeper level's pool ids [D-1, K*K] and one-hot depth masks [D, D]: made once per (K, D, device), outside any CUDA
    graph capture (a graph's warm-up runs the step eagerly first)."""
    rank = torch.cat([torch.arange(K)] + [torch.arange(K).repeat(K)] * (D - 1))
    depth = torch.cat([torch.ones(K, dtype=torch.long)] + [torch.full((K * K,), d + 1) for d in range(1, D)])
    path = torch.full((1, K, D), -1, dtype=torch.long)
    path[0, :, 0] = torch.arange(K)
    child_ids = K + torch.arange((D - 1) * K * K).view(D - 1, K * K)
    return (rank.to(device), depth.to(device), torch.eye(K, dtype=torch.bool, device=device)[None], path.to(device),
            child_ids.to(device), torch.eye(D, dtype=torch.bool, device=device))
