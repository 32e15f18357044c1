"""The tree dispatcher: the speculation tree is chosen per decode step by the batch size.

A speculative step must cost less than the tokens it buys. Verifying a 25-node tree is nearly free at batch 1 (the
step reads the weights once either way) but not at batch 32, where the verify pass holds 800 tokens and the GEMMs
stop being bandwidth-bound; there a chain, or no speculation at all, commits tokens faster. The paper picks the tree
by batch size; so does this.

Spelling: `dispatch:B1=SPEC1,B2=SPEC2,...` with increasing batch bounds: a step of n sequences uses the first entry
with n <= B, and the last entry beyond the largest bound. SPEC is `chain:K`, `tree:NAME`, a tree JSON file or
`plain` (the bare root: no draft tokens; the draft still reads the committed pairs, so a later step can speculate).
Example: `dispatch:1=tree:mc_sim_7b_63,4=tree:8,16=chain:3,256=plain`.

Sampled requests accept less: at temperature 1 the shipped SmolLM2 draft's trees commit ~2 tokens a step where
greedy ones commit ~3.8, and every speculative mode lost to plain decoding (H100, session 59), while at 0.3 the
greedy choices still won. So a speculation may add temperature bands: `SPEC|T1=SPEC1|T2=SPEC2` with increasing
T: a step whose hottest request has temperature t >= T_k (the largest such k) uses SPEC_k, a step below T1 (greedy
ones included) uses SPEC. Each SPEC is a dispatch, a single tree or `plain`. Example:
`dispatch:2=tree:smollm2_48d5,256=chain:3|0.5=dispatch:2=tree:smollm2_48d5,256=plain|0.85=plain`. A request at
least as hot as the bands' last plain temperature (`plain_from`, 0.85 here) never speculates, so a step of such
requests alone runs without the draft (`eyas.engine.runner.ModelRunner.bare_tree`).

The step keeps every cache exact whichever tree it uses (`eyas.spec.step.spec_step`): switching trees between steps
changes nothing of the committed history, only how many tokens a step may commit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eyas.spec.tree import Tree

PREFIX = "dispatch:"


@dataclass
class TreeDispatch:
    bounds: list[int]  # increasing batch-size bounds
    trees: list[Tree]  # trees[i] serves batches up to bounds[i] (the last one also beyond)
    name: str
    # temperature bands: (T, the dispatch of steps whose hottest request has temperature >= T), T increasing
    bands: list[tuple[float, "TreeDispatch"]] = field(default_factory=list)

    def tree_for(self, batch_size: int, temperature: float = 0.0) -> Tree:
        d = self
        for t, band in self.bands:
            if temperature >= t:
                d = band
        for bound, tree in zip(d.bounds, d.trees):
            if batch_size <= bound:
                return tree
        return d.trees[-1]

    @property
    def temperatures(self) -> list[float]:
        """The lowest temperature of each band (0 for the first): one per dispatch a step can take."""
        return [0.0] + [t for t, _ in self.bands]

    @property
    def plain_from(self) -> float | None:
        """The lowest band temperature from which every band is plain (no tree of any batch size drafts), or None.
        A step takes its hottest request's band, so a request at least this hot takes only plain steps, in any
        batch: its draft need not read along (`eyas.engine.runner.ModelRunner.launch`)."""
        out = None
        for t, trees in reversed([(0.0, self.trees)] + [(t, band.trees) for t, band in self.bands]):
            if any(tree.num_nodes for tree in trees):
                break
            out = t
        return out

    @property
    def all_trees(self) -> list[Tree]:
        return self.trees + [t for _, band in self.bands for t in band.trees]

    @property
    def max_depth(self) -> int:
        """The deepest tree's depth: what the KV reservation and the draft's catch-up window must allow for."""
        return max(t.max_depth for t in self.all_trees)

    @property
    def num_nodes(self) -> int:
        return max(t.num_nodes for t in self.all_trees)

    def to(self, device) -> "TreeDispatch":
        return TreeDispatch(list(self.bounds), [t.to(device) for t in self.trees], self.name,
                            [(t, band.to(device)) for t, band in self.bands])


def parse_bands(spec: str) -> TreeDispatch:
    """`SPEC|T1=SPEC1|T2=SPEC2...` -> a TreeDispatch with temperature bands (see the module docstring); each SPEC a
    dispatch, a tree (`chain:K`, `tree:NAME`, `dyn:...`, a JSON file) or `plain`."""
    parts = spec.split("|")

    def one(s: str) -> TreeDispatch:
        s = s.strip()
        return parse_dispatch(s, allow_plain=True) if s.startswith(PREFIX) else parse_dispatch(f"{PREFIX}1={s}",
                                                                                                   allow_plain=True)
    base = one(parts[0])
    for item in parts[1:]:
        t, eq, s = item.partition("=")
        try:
            temp = float(t)
        except ValueError:
            temp = float("nan")  # refused below, as nan itself is
        if not eq or not temp > 0:
            raise ValueError(f"bad speculation {spec!r}: a temperature band is T=SPEC with T > 0 (got {item!r})")
        if base.bands and temp <= base.bands[-1][0]:
            raise ValueError(f"bad speculation {spec!r}: temperature bands must be increasing")
        base.bands.append((temp, one(s)))
    if all(t.num_nodes == 0 for t in base.all_trees):
        raise ValueError(f"bad speculation {spec!r}: every entry is plain")
    base.name = spec
    return base


def parse_dispatch(spec: str, allow_plain: bool = False) -> TreeDispatch:
    """`dispatch:B1=SPEC1,B2=SPEC2,...` -> TreeDispatch (see the module docstring). `allow_plain`: every entry may
    be plain (a temperature band's, `parse_bands`)."""
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
    if all(t.num_nodes == 0 for t in trees) and not allow_plain:
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
