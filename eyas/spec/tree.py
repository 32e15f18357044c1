"""Static speculation trees.

A tree is a list of paths of top-k ranks, in EAGLE's "choices" format: `(0,)` is the draft's best token after the
root, `(0, 1)` the second-best child of that one, and so on. Node 0 is the root (the last committed token); node i
(1..N) is `paths[i-1]` after sorting by (depth, path), so each level is a contiguous range of node indices.
A chain of length K is the tree `[(0,), (0, 0), ...]`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

# EAGLE's default tree for 7B models (SafeAILab/EAGLE, `mc_sim_7b_63`): 25 nodes, depth 5.
MC_SIM_7B_63 = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0], [0, 0, 1],
    [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]
# Small trees for large batches, where verification of many tokens stops being free.
TREE_8 = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
TREE_16 = [[0], [1], [2], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
           [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0, 0]]
# Trees fitted to the shipped SmolLM2 draft by `eyas make-tree` (eyas/spec/trees/smollm2-N.json -> "smollm2_N"):
# N nodes, depth <= 8, refit on the roots decoding visits, fitted on SmolLM2's answers to ShareGPT prompts the draft
# was not trained on; smollm2_48d5 (48 nodes, depth <= 5) is the one of the least predicted time per token at batch 1
# on the H200 (`--step-cost`, docs/benchmarks.md, "Trees fitted to the draft").
FITTED = {f.stem.replace("-", "_"): json.loads(f.read_text())
          for f in sorted((Path(__file__).parent / "trees").glob("*.json"))}
PRESETS = {"mc_sim_7b_63": MC_SIM_7B_63, "8": TREE_8, "16": TREE_16, **FITTED}


@dataclass
class Tree:
    name: str
    paths: list[tuple[int, ...]]  # sorted; node i = paths[i - 1]
    parents: torch.Tensor  # [N+1] int64, root's parent is -1
    depth: torch.Tensor  # [N+1] int64, root has depth 0
    rank: torch.Tensor  # [N+1] top-k rank among siblings (root: 0)
    ancestor_mask: torch.Tensor  # [N+1, N+1] bool, [i, j] = j is i or an ancestor of i
    children: torch.Tensor  # [N+1, max_children] int64, by rank, -1 padded
    levels: list[range]  # node indices of each depth, levels[0] = range(0, 1)
    topk_per_level: list[int]  # how many draft candidates each level's nodes need (max child rank + 1)
    rank_paths: torch.Tensor  # [N+1, max(D, 1)] int64: node i's path of ranks, -1 past its depth (root: all -1)
    _level_index: dict = field(default_factory=dict, repr=False, compare=False)  # device -> `level_index`

    def level_index(self, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per level d < max_depth, for the nodes of level d+1: where each one's token sits in level d's top-k
        flattened to [parent within the level x k] (parent * k + rank, k = topk_per_level[d]), and their parents'
        node ids; device tensors made once per device (drafting then indexes with them and computes none; the first
        call is eager, e.g. a CUDA graph's warm-up, never inside a capture)."""
        key = str(torch.device(device))
        if key not in self._level_index:
            out = []
            for d in range(self.max_depth):
                nxt = self.levels[d + 1]
                par = self.parents[nxt.start: nxt.stop].cpu()
                pick = (par - self.levels[d].start) * self.topk_per_level[d] + self.rank[nxt.start: nxt.stop].cpu()
                out.append((pick.to(device), par.to(device)))
            self._level_index[key] = out
        return self._level_index[key]

    def to(self, device) -> "Tree":
        """The same tree with its tensors on `device` (so that a step makes no host->device copies)."""
        from dataclasses import replace
        return replace(self, parents=self.parents.to(device), depth=self.depth.to(device), rank=self.rank.to(device),
                       ancestor_mask=self.ancestor_mask.to(device), children=self.children.to(device),
                       rank_paths=self.rank_paths.to(device))

    @property
    def num_nodes(self) -> int:
        """Draft tokens in the tree (the root excluded)."""
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return len(self.levels) - 1

    @classmethod
    def from_paths(cls, paths, name: str = "custom") -> "Tree":
        ps = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if len(ps) != len(paths):
            raise ValueError(f"tree {name!r} repeats a path")
        index = {(): 0}
        for i, p in enumerate(ps, start=1):
            if not p or any(r < 0 for r in p):
                raise ValueError(f"tree {name!r}: path {list(p)} must be a non-empty list of ranks >= 0")
            if p[:-1] not in index:
                raise ValueError(f"tree {name!r}: path {list(p)} has no parent {list(p[:-1])} in the tree")
            index[p] = i
        n = len(ps) + 1
        parents = [-1] + [index[p[:-1]] for p in ps]
        depth = [0] + [len(p) for p in ps]
        rank = [0] + [p[-1] for p in ps]
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = parents[j]
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[parents[i]].append(i)
        width = max(1, max(len(k) for k in kids))
        children = torch.full((n, width), -1, dtype=torch.long)
        for i, k in enumerate(kids):
            k.sort(key=lambda c: rank[c])
            children[i, : len(k)] = torch.tensor(k, dtype=torch.long)
        D = max(depth)
        levels = [range(depth.index(d), depth.index(d) + depth.count(d)) for d in range(D + 1)]
        topk = [max([rank[c] + 1 for i in lv for c in kids[i]], default=0) for lv in levels]
        rank_paths = torch.full((n, max(D, 1)), -1, dtype=torch.long)
        for i, p in enumerate(ps, start=1):
            rank_paths[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        return cls(name, ps, torch.tensor(parents), torch.tensor(depth), torch.tensor(rank), mask, children,
                   levels, topk, rank_paths)

    @classmethod
    def chain(cls, k: int) -> "Tree":
        if k < 0:
            raise ValueError(f"chain length must be >= 0, got {k}")
        return cls.from_paths([[0] * d for d in range(1, k + 1)], name=f"chain:{k}")


def resolve_tree(spec: str | None):
    """`None`, `chain:K`, `tree:NAME` (mc_sim_7b_63, 8, 16), the path of a JSON list of paths (bare or as
    `tree:PATH`), `dyn:kKdDnN` (a tree grown per step from the draft's confidence: `eyas.spec.dynamic_tree`), or
    `dispatch:B1=SPEC1,...` (a tree per batch size: `eyas.spec.dispatch`), and any of them with temperature bands
    (`SPEC|T=SPEC...`, `eyas.spec.dispatch.parse_bands`). -> Tree | DynamicTree | TreeDispatch | None"""
    if spec is None:
        return None
    if "|" in spec:  # temperature bands
        from eyas.spec.dispatch import parse_bands
        return parse_bands(spec)
    if spec.startswith("dyn:"):
        from eyas.spec.dynamic_tree import DynamicTree
        return DynamicTree.parse(spec)
    if spec.startswith("dispatch:"):
        from eyas.spec.dispatch import parse_dispatch
        return parse_dispatch(spec)
    if spec.startswith("chain:"):
        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"bad speculation {spec!r}: expected chain:K with an integer K") from None
        return Tree.chain(k)
    if spec.startswith("tree:"):
        name = spec.split(":", 1)[1]
        if name in PRESETS:
            return Tree.from_paths(PRESETS[name], name=spec)
        if not (name.endswith(".json") or Path(name).is_file()):
            raise ValueError(f"unknown tree preset {name!r}; presets: {', '.join(PRESETS)} (or a JSON file of paths)")
        spec = name  # `tree:PATH`, as a bare PATH
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"tree file {spec} does not exist")
        try:
            paths = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"tree file {spec} is not valid JSON: {e}") from None
        if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
            raise ValueError(f"tree file {spec} must hold a JSON list of paths (lists of ranks)")
        return Tree.from_paths(paths, name=path.name)
    raise ValueError(f"bad speculation {spec!r}: expected chain:K, tree:NAME ({', '.join(PRESETS)}), dyn:kKdDnN or a "
                     "JSON file")
