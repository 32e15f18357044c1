"""The tree dispatcher: the speculation tree is chosen per decode step by the batch size.

A speculative step must cost less than the tokens it buys. Verifying a 25-node tree is nearly free at batch 1 (the
step reads the weights once either way) but not at batch 32, where the verify pass holds 800 tokens and the GEMMs
stop being bandwidth-bound; there a chain, or no speculation at all, commits tokens faster. The paper picks the tree
by batch size; so does this.

Spelling: `dispatch:B1=SPEC1,B2=SPEC2,...` with increasing batch bounds: a step of n sequences uses the first entry
with n <= B, and the last entry beyond the largest bound. SPEC is `chain:K`, `tree:NAME`, a tree JSON file or
`plain` (the bare root: no draft tokens; the draft still reads the committed pairs, so a later step can speculate).
Example: `dispatch:1=tree:mc_sim_7b_63,4=tree:8,16=chain:3,256=plain`.

The step keeps every cache exact whichever tree it uses (`eyas.spec.step.spec_step`): switching trees between steps
changes nothing of the committed history, only how many tokens a step may commit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.spec.tree import Tree

PREFIX = "dispatch:"


@dataclass
class TreeDispatch:
    bounds: list[int]  # increasing batch-size bounds
    trees: list[Tree]  # trees[i] serves batches up to bounds[i] (the last one also beyond)
    name: str

    def tree_for(self, batch_size: int) -> Tree:
        for bound, tree in zip(self.bounds, self.trees):
            if batch_size <= bound:
                return tree
        return self.trees[-1]

    @property
    def max_depth(self) -> int:
        """The deepest tree's depth: what the KV reservation and the draft's catch-up window must allow for."""
        return max(t.max_depth for t in self.trees)

    @property
    def num_nodes(self) -> int:
        return max(t.num_nodes for t in self.trees)

    def to(self, device) -> "TreeDispatch":
        return TreeDispatch(list(self.bounds), [t.to(device) for t in self.trees], self.name)


def parse_dispatch(spec: str) -> TreeDispatch:
    """`dispatch:B1=SPEC1,B2=SPEC2,...` -> TreeDispatch (see the module docstring)."""
    from eyas.spec.tree import resolve_tree

    body = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    bounds, trees = [], []
    for item in body.split(","):
        if "=" not in item:
            raise ValueError(f"bad speculation {spec!r}: expected {PREFIX}B1=SPEC1,B2=SPEC2,... (got {item!r})")
        b, s = (x.strip() for x in item.split("=", 1))
        try:
            bound = int(b)
        except ValueError:
            raise ValueError(f"bad speculation {spec!r}: batch bound {b!r} is not an integer") from None
        if bound < 1 or (bounds and bound <= bounds[-1]):
            raise ValueError(f"bad speculation {spec!r}: batch bounds must be >= 1 and increasing")
        if s == "plain":
            tree = Tree.chain(0)
        elif s.startswith(PREFIX):
            raise ValueError(f"bad speculation {spec!r}: a dispatch entry cannot be a dispatch")
        else:
            tree = resolve_tree(s)
        bounds.append(bound)
        trees.append(tree)
    if all(t.num_nodes == 0 for t in trees):
        raise ValueError(f"bad speculation {spec!r}: every entry is plain")
    return TreeDispatch(bounds, trees, spec)


def compose_dispatch(choices: dict[int, str]) -> str:
    """{batch size: SPEC} (each the fastest speculation measured at that batch size) -> the dispatcher that uses it:
    batch sizes in increasing order, neighbours with the same SPEC merged, each entry bounded by its largest batch
    size (so a batch between two measured sizes takes the larger one's choice; beyond the largest, the last
    entry). `{1: "tree:a", 2: "tree:a", 8: "tree:8", 64: "chain:3"}` -> `dispatch:2=tree:a,8=tree:8,64=chain:3`."""
    if not choices:
        raise ValueError("compose_dispatch needs at least one (batch size, speculation)")
    entries: list[list] = []
    for b in sorted(choices):
        if b < 1:
            raise ValueError(f"compose_dispatch: batch sizes must be >= 1, got {b}")
        if entries and entries[-1][1] == choices[b]:
            entries[-1][0] = b
        else:
            entries.append([b, choices[b]])
    spec = PREFIX + ",".join(f"{b}={s}" for b, s in entries)
    parse_dispatch(spec)  # every SPEC valid, and not all plain
    return spec


def default_speculation(draft, device) -> str:
    """The speculation to use with `draft` when none is asked: the draft's own choice for this device type
    (config.json `eyas_speculation`, e.g. {"cuda": "dispatch:2=tree:smollm2_48d5,16=dyn:k4d3n8,32=tree:8,256=chain:3",
    "cpu": "chain:3"}: trees fitted to that draft, batch bounds measured with it on that device), else `chain:3`."""
    choice = getattr(getattr(draft, "config", None), "speculation", None) or {}
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return choice.get(kind, choice.get("default", "chain:3"))
