"""Draft acceptance by MT-Bench category: chain:3, T=0, first turns, 64 new tokens, float32 on the CPU.
    PYTHONPATH=. python3 tools/diag/tpc_by_category.py [DRAFT_DIR ...]   (from the repository root; ~1.5 min per
    draft on 2 cores; no argument: the shipped draft)
Since session 23 `eyas bench tpc` reports TPC by prompt category itself (tpc.json's `by_category`, tpc.md's second
table); this runs it with the settings of the by-category tables in docs/ and prints that table, a column pair per
draft in the order given (the target's text is the same for all: greedy, and verification keeps it the target's).
Used for docs/benchmarks.md ("By MT-Bench category", 2026-11-29; run K against run L, 2026-11-30) and
docs/draft-training.md (runs M and N)."""
import sys

from eyas.bench.tpc import bench_tpc, category_table

drafts = sys.argv[1:] or ["default"]
report = bench_tpc("smollm2", drafts, ["chain:3"], "../shared/data/mt_bench/question.jsonl", [0.0], max_tokens=64,
                   device="cpu", dtype="float32", log=lambda *a: None)
print(category_table(report["results"]), end="")
for r in report["results"]:
    print(f"all 80 ({r['draft']}): TPC {r['tpc']:.3f}, acc@1 {r['acceptance_by_depth'][0]:.3f}")
