"""Guided decoding and disaggregated prefill/decode on the GPU, against their references (session 49's plan).

On the tiny mirror pair over a byte-level tokenizer (tests/test_guided.py's), float32 on cuda:0:
1. guided greedy outputs with speculation (chain:3, tree:8, dyn:k4d3n8) and CUDA graphs on (a guided step runs
   eagerly; an unguided request in the same batch too) equal plain guided decoding on the GPU, and the CPU's;
2. `LLM(disaggregate="cuda:0,cuda:0")` equals one engine (outputs and acceptance), guided requests among them;
3. the step's time, guided and not, at batch 1 (ms a decode step; the graphs' steps beside the eager guided ones).
Prints one JSON line per check, and writes them to $OUT/guided_disagg_gpu.json. `DEV=cpu` dry-runs it here.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import torch  # noqa: E402

from eyas import LLM, GuidedDecoding, SamplingParams  # noqa: E402
from test_guided import write_guided_mirror  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
GUIDES = [GuidedDecoding(regex=r"(yes|no), [0-9]{1,3}!"), GuidedDecoding(json_object=True),
          GuidedDecoding(regex=r"[a-z ]{5,60}\."), GuidedDecoding(choice=["abc", "ba"]), None]
PROMPTS = ["Hello there", "yes or no?", "{\"", "abcabc abcabc"]


def outputs(llm, prompts, params):
    out = llm.generate(prompts, params)
    return [(o.token_ids, o.finish_reason, o.stats.accepted_by_depth) for o in out]


def main() -> int:
    results = []
    d = Path(tempfile.mkdtemp())
    target, draft, _ = write_guided_mirror(d)
    target, draft = str(target), str(draft)
    params = [SamplingParams(max_tokens=40, guided=g) for g in GUIDES]
    prompts = [p for p in PROMPTS for _ in GUIDES]
    plist = params * len(PROMPTS)
    cpu = LLM(target, device="cpu", dtype="float32")
    gpu_plain = LLM(target, device=DEV, dtype="float32", cuda_graphs="auto")
    ref_cpu = [o[:2] for o in outputs(cpu, prompts, plist)]
    ref_gpu = outputs(gpu_plain, prompts, plist)
    results.append({"check": "plain guided, GPU == CPU", "ok": [o[:2] for o in ref_gpu] == ref_cpu})
    for spec in ("chain:3", "tree:8", "dyn:k4d3n8"):
        llm = LLM(target, device=DEV, dtype="float32", draft=draft, speculation=spec, cuda_graphs="auto")
        got = outputs(llm, prompts, plist)
        acc = sum(sum(o[2]) for o in got)
        results.append({"check": f"speculative guided == plain guided, {spec}, GPU, graphs on",
                        "ok": [o[:2] for o in got] == [o[:2] for o in ref_gpu], "accepted": acc,
                        "decode_steps": llm.engine.runner.tree_steps})
        if spec == "tree:8":
            one = got
    dis = LLM(target, dtype="float32", draft=draft, speculation="tree:8", cuda_graphs="auto",
              disaggregate=f"{DEV}:0,{DEV}:0" if DEV == "cuda" else "cpu,cpu")
    try:
        got = outputs(dis, prompts, plist)
        results.append({"check": "disaggregated cuda:0,cuda:0 == one engine (tokens and acceptance), tree:8",
                        "ok": got == one, "decode_prefills": dis.engine.decode.step_counts["prefill"]})
    finally:
        dis.engine.close()
    # step times at batch 1: the same prompt guided (eager steps) and free (graphed steps)
    llm = LLM(target, device=DEV, dtype="float32", draft=draft, speculation="tree:8", cuda_graphs="auto")
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    for name, g in (("free", None), ("guided regex", GuidedDecoding(regex=r"[a-z ]{5,400}\."))):
        sp = SamplingParams(max_tokens=200, guided=g, ignore_eos=True)
        llm.generate(["Hello there"], sp)  # warm-up (graphs, compiles)
        sync()
        t0 = time.perf_counter()
        o = llm.generate(["Hello there"], sp)[0]
        sync()
        wall = time.perf_counter() - t0
        results.append({"check": f"batch-1 step time, {name}", "ms_per_step": round(wall * 1e3 / o.stats.target_calls,
                                                                                    3),
                        "tokens": len(o.token_ids), "steps": o.stats.target_calls})
    for r in results:
        print(json.dumps(r), flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "guided_disagg_gpu.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("ok", True) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
