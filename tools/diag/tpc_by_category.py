"""Draft acceptance by MT-Bench category: chain:3, T=0, first turns, 64 new tokens, float32 on the CPU.
    PYTHONPATH=. python3 tools/diag/tpc_by_category.py [DRAFT_DIR ...]   (from the repository root; ~1.5 min per
    draft on 2 cores; no argument: the shipped draft)
With several drafts, one TPC and depth-1 acceptance column pair per draft, in the order given (the target's text is
the same for all: greedy, and verification keeps it the target's).
Used for docs/benchmarks.md ("By MT-Bench category", 2026-11-29; run K against run L, 2026-11-30)."""
import collections
import json
import sys

from eyas import LLM, SamplingParams

drafts = sys.argv[1:] or ["default"]
qs = [json.loads(l) for l in open("../shared/data/mt_bench/question.jsonl") if l.strip()]
convs = [[{"role": "user", "content": q["turns"][0]}] for q in qs]
cats = list(dict.fromkeys(q["category"] for q in qs))
tables = []
for d in drafts:
    llm = LLM("smollm2", device="cpu", dtype="float32", draft=d, speculation="chain:3")
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=64))
    agg = collections.defaultdict(lambda: [0, 0, 0, 0])
    for q, o in zip(qs, outs):
        a = agg[q["category"]]
        a[0] += o.stats.committed; a[1] += o.stats.target_calls; a[2] += o.stats.accepted_by_depth[0]; a[3] += 1
    agg["all"] = [sum(v[i] for v in list(agg.values())) for i in range(4)]
    tables.append(agg)
first = tables[0]
rows = sorted(cats, key=lambda c: -first[c][0] / first[c][1]) + ["all"]
head = " | ".join(f"TPC ({d}) | depth-1 ({d})" for d in drafts)
print(f"| category | prompts | {head} |\n| --- | --- |" + " --- | --- |" * len(drafts))
for c in rows:
    cells = " | ".join(f"{t[c][0] / t[c][1]:.2f} | {t[c][2] / t[c][1]:.2f}" for t in tables)
    print(f"| {c} | {first[c][3]} | {cells} |")
