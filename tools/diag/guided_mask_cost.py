"""The host's cost of guided decoding: the vocabulary index (`GrammarBackend`, made once an engine) and a schema's
compile, first and cached; then a guided step's masks: microseconds to fill one tree's bitmasks (`GrammarState.tree_bitmask`,
xgrammar's tree walk) against the plain walk over matcher forks (`tree_bitmask_reference`), with SmolLM2's
tokenizer and a JSON schema, at points along a real JSON answer.

Each tree has the shape of a preset (default `tree:smollm2_48d5`); its rank-0 path holds the answer's next tokens
(what a good draft proposes), its other nodes tokens the grammar allows after their parent where there are some
(the draft's other guesses), so most nodes are reachable, as in a step that accepts well.

    python tools/diag/guided_mask_cost.py [--tree tree:smollm2_48d5] [--repeat 20]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from eyas.loader.gguf import load_gguf_tokenizer
from eyas.loader.resolve import smollm2_path
from eyas.sampling_params import GuidedDecoding
from eyas.spec.grammar import GrammarBackend, allowed_tokens, tree_bitmask_reference
from eyas.spec.tree import resolve_tree

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "ingredients": {"type": "array", "items": {
    "type": "string"}}, "steps": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "ingredients", "steps"]}
ANSWER = ('{"title": "Pancakes", "ingredients": ["flour", "milk", "two eggs", "a pinch of salt"], "steps": ['
          '"Whisk the flour and the salt.", "Add the milk and the eggs.", "Cook in a hot pan until golden."]}')


def trees(tok, be, tree, rng):
    """(state, tokens, parents) at every 8th position of the answer."""
    ids = tok.encode(ANSWER)
    parents = tree.parents.numpy()
    depth = tree.depth.numpy()
    rank = tree.rank.numpy()
    out = []
    for start in range(0, len(ids) - tree.max_depth, 8):
        st = be.state(GuidedDecoding(json=SCHEMA))
        st.accept(ids[:start])
        tokens = np.zeros(len(parents), dtype=np.int64)
        for i in range(1, len(parents)):
            on_path = rank[i] == 0 and all(rank[j] == 0 for j in _ancestors(parents, i))
            if on_path:
                tokens[i] = ids[start + depth[i] - 1]
                continue
            path, j = [], parents[i]
            while j > 0:
                path.append(int(tokens[j]))
                j = parents[j]
            m = st.matcher.fork()
            ok = all(not m.is_terminated() and m.accept_token(t) for t in reversed(path)) and not m.is_terminated()
            allowed = []
            if ok:
                mask = torch.zeros(1, be.words, dtype=torch.int32)
                m.fill_next_token_bitmask(mask, 0)
                allowed = torch.nonzero(allowed_tokens(mask, be.vocab_size)[0]).flatten().tolist()
            tokens[i] = int(rng.choice(allowed)) if allowed else int(rng.integers(0, be.vocab_size))
        out.append((st, tokens, parents))
    return out


def _ancestors(parents, i):
    j = parents[i]
    while j > 0:
        yield j
        j = parents[j]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default="tree:smollm2_48d5")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    tok = load_gguf_tokenizer(smollm2_path())
    t0 = time.perf_counter()
    be = GrammarBackend(tok, 49152, [tok.eos_token_id])
    index_s = time.perf_counter() - t0
    compile_ms = []
    for _ in range(2):  # the first compile, then xgrammar's cache
        t0 = time.perf_counter()
        be.compile(GuidedDecoding(json=SCHEMA))
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    tree = resolve_tree(args.tree)
    cases = trees(tok, be, tree, np.random.default_rng(0))
    out = torch.zeros(len(tree.parents), be.words, dtype=torch.int32)
    ref = torch.zeros_like(out)
    res = {}
    for name, fn in (("traverse_draft_tree", lambda s, t, p: s.tree_bitmask(t, p, out)),
                     ("reference (forks)", lambda s, t, p: tree_bitmask_reference(s, t, p, ref))):
        per_tree = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            for st, tokens, parents in cases:
                fn(st, tokens, parents)
            per_tree.append((time.perf_counter() - t0) / len(cases) * 1e6)
        res[name] = statistics.median(per_tree)
    for st, tokens, parents in cases:  # the two agree
        st.tree_bitmask(tokens, parents, out)
        tree_bitmask_reference(st, tokens, parents, ref)
        assert torch.equal(out, ref)
    n = len(tree.parents)
    print(json.dumps({"vocabulary index s": round(index_s, 3), "schema compile ms": round(compile_ms[0], 2),
                      "cached compile ms": round(compile_ms[1], 3), "tree": tree.name, "nodes": n, "trees": len(cases), "repeat": args.repeat,
                      **{f"{k} us/tree": round(v, 1) for k, v in res.items()},
                      **{f"{k} us/node": round(v / n, 2) for k, v in res.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
