"""How often the draft proposes what the grammar refuses, and how many guided tokens the grammar forces.

SmolLM2 with its shipped draft answers the JSON tasks (docs/bench/json_tasks.jsonl) under their schemas, greedily,
on the CPU. Every guided step's masks (`TreeGuide.masks`, xgrammar's) are read as they are made: a drafted token is
refused when its parent's mask forbids it (the root's children: the draft's first level, which the grammar
restricts since ad51960; deeper nodes, which it proposes freely). Then each output is replayed through a fresh
matcher: a token is forced where the grammar allowed it alone (what a draft made of the grammar's forced tokens
could guess without fail). Prints one JSON line.

    python tools/diag/guided_draft_refusals.py [--speculation chain:3] [--max-tokens 256] [--limit N]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from eyas import LLM, SamplingParams
from eyas.bench.tpc import guide_of
from eyas.spec.grammar import TreeGuide, allowed_tokens

TASKS = Path(__file__).resolve().parents[2] / "docs/bench/json_tasks.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speculation", default="chain:3")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    recs = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()][:args.limit]
    llm = LLM("smollm2", device="cpu", dtype="float32", draft="default", speculation=args.speculation)
    V = llm.target.config.vocab_size
    count = {"steps": 0, "root_children": 0, "root_children_refused": 0, "deeper": 0, "deeper_refused": 0}
    masks = TreeGuide.masks

    def counting(self, tokens, parents, out):
        r = masks(self, tokens, parents, out)
        for b, st in enumerate(self.states):
            if st is None:
                continue
            par = parents if parents.ndim == 1 else parents[b]
            count["steps"] += 1
            for i in range(1, len(par)):
                kind = "root_children" if par[i] == 0 else "deeper"
                count[kind] += 1
                count[kind + "_refused"] += not bool(allowed_tokens(r[b, par[i]], V)[tokens[b][i]])
        return r
    TreeGuide.masks = counting
    params = [SamplingParams(max_tokens=args.max_tokens, guided=guide_of(r, TASKS)) for r in recs]
    outs = llm.chat([[{"role": "user", "content": r["prompt"]}] for r in recs], params)
    TreeGuide.masks = masks
    backend = llm.engine.grammar_backend()
    tokens = forced = 0
    for o, p in zip(outs, params):
        st = backend.state(p.guided)
        mask = torch.empty((1, st.words), dtype=torch.int32)
        for t in o.token_ids:
            if st.terminated:
                break
            st.fill(mask, 0)
            tokens += 1
            forced += int(np.unpackbits(mask.numpy().view(np.uint8)).sum()) == 1
            st.accept([t])
    calls = sum(o.stats.target_calls for o in outs)
    print(json.dumps({"speculation": args.speculation, "prompts": len(recs), "committed": sum(len(o.token_ids)
                      for o in outs), "tpc": round(sum(len(o.token_ids) for o in outs) / calls, 3), **count,
                      "guided_tokens": tokens, "forced_tokens": forced}))


if __name__ == "__main__":
    main()
