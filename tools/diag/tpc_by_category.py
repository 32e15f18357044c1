"""Draft acceptance by MT-Bench category: chain:3, T=0, first turns, 64 new tokens, float32 on the CPU, shipped draft.
    PYTHONPATH=. python3 tools/diag/tpc_by_category.py    (run from the repository root; ~1.5 min on 2 cores)
Used for docs/benchmarks.md ("By MT-Bench category", 2026-11-29)."""
import collections
import json

from eyas import LLM, SamplingParams
qs = [json.loads(l) for l in open("../shared/data/mt_bench/question.jsonl") if l.strip()]
llm = LLM("smollm2", device="cpu", dtype="float32", draft="default", speculation="chain:3")
convs = [[{"role": "user", "content": q["turns"][0]}] for q in qs]
outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=64))
agg = collections.defaultdict(lambda: [0, 0, 0, 0])
for q, o in zip(qs, outs):
    a = agg[q["category"]]
    a[0] += o.stats.committed; a[1] += o.stats.target_calls; a[2] += o.stats.accepted_by_depth[0]; a[3] += 1
rows = sorted(agg.items(), key=lambda kv: -kv[1][0] / kv[1][1])
print("| category | prompts | TPC | depth-1 acceptance |\n| --- | --- | --- | --- |")
for c, (com, calls, a1, n) in rows:
    print(f"| {c} | {n} | {com / calls:.2f} | {a1 / calls:.2f} |")
tot = [sum(v[i] for v in agg.values()) for i in range(3)]
print(f"| all | {len(qs)} | {tot[0] / tot[1]:.2f} | {tot[2] / tot[1]:.2f} |")
