"""Guided decoding and disaggregated prefill/decode on the GPU, against their references (session 49's plan).

On the tiny mirror pair over a byte-level tokenizer (tests/test_guided.py's), float32 on cuda:0:
1. guided greedy outputs with speculation (chain:3, tree:8, dyn:k4d3n8) and CUDA graphs on (a guided step runs
   eagerly; an unguided request in the same batch too) equal plain guided decoding on the GPU, and the CPU's;
2. `LLM(disaggregate="cuda:0,cuda:0")` equals one engine (outputs and acceptance), guided requests among them;
3. the step's time, guided and not, at batch 1 (ms a decode step): free steps on graphs, guided steps on their three
   graphs (session 50) and eagerly (as before; `EAGER_GUIDED`);
4. with SmolLM2 staged (`SMOLLM2=1`): its shipped draft and GPU default speculation, bf16, batch 1, greedy, the 24
   JSON tasks of docs/bench/json_tasks.jsonl (each under its schema, and free), `MAX_TOKENS` (256) each: ms a token
   and a step, TPC, the guided outputs that ended valid; guided on graphs and eagerly. `TINY=0`: this check only.
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
from helpers import write_guided_mirror  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
GUIDES = [GuidedDecoding(regex=r"(yes|no), [0-9]{1,3}!"), GuidedDecoding(json_object=True),
          GuidedDecoding(regex=r"[a-z ]{5,60}\."), GuidedDecoding(choice=["abc", "ba"]), None]
PROMPTS = ["Hello there", "yes or no?", "{\"", "abcabc abcabc"]


def outputs(llm, prompts, params):
    out = llm.generate(prompts, params)
    return [(o.token_ids, o.finish_reason, o.stats.accepted_by_depth) for o in out]


def eager_guided(llm):
    """Make `llm`'s guided steps run eagerly (as before session 50): no graph for a batch with a guided request."""
    g = llm.engine.runner.graphs
    if g is not None:
        can_run = g.can_run
        g.can_run = lambda seqs: can_run(seqs) and all(s.grammar is None for s in seqs)
    return llm


def timed(llm, prompts, params, sync):
    """(wall seconds, outputs) of one generate call after a warm-up one on the first prompt."""
    llm.generate(prompts[:1], params[:1])
    sync()
    t0 = time.perf_counter()
    out = llm.generate(prompts, params)
    sync()
    return time.perf_counter() - t0, out


def smollm2(results, sync) -> None:
    """Check 4 (SmolLM2 on json_tasks, batch 1: one request at a time)."""
    from eyas.bench.tpc import guide_of, matches_guide
    from eyas.spec.grammar import TreeGuide
    path = Path(__file__).resolve().parents[2] / "docs/bench/json_tasks.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    n = int(os.environ.get("LIMIT", len(recs)))
    recs = recs[:n]
    kw = dict(device=DEV, dtype="bfloat16" if DEV == "cuda" else "float32", draft="default",
              cuda_graphs=DEV == "cuda")
    max_tokens = int(os.environ.get("MAX_TOKENS", 256))
    for mode in ("free", "guided, graphs", "guided, eager", "free"):
        llm = LLM("smollm2", **kw)
        if mode == "guided, eager":
            eager_guided(llm)
        chats = [[{"role": "user", "content": r["prompt"]}] for r in recs]
        guides = [guide_of(r, path) if mode != "free" else None for r in recs]
        params = [SamplingParams(max_tokens=max_tokens, guided=g) for g in guides]
        t0 = time.perf_counter()
        llm.chat(chats[:1], params[:1])  # warm-up: graphs, compiles, the grammar's vocabulary
        sync()
        warm = time.perf_counter() - t0
        # every prompt's prefill once (its Triton compiles: the first mode would pay them inside its timing), and
        # every schema compiled
        llm.chat(chats, [SamplingParams(max_tokens=2, guided=p.guided) for p in params])
        sync()
        mask_s = [0.0]
        masks = TreeGuide.masks

        def timed_masks(self, *a, **k):
            t = time.perf_counter()
            try:
                return masks(self, *a, **k)
            finally:
                mask_s[0] += time.perf_counter() - t
        TreeGuide.masks = timed_masks
        wall = steps = tokens = valid = ended = 0
        for c, p in zip(chats, params):  # batch 1
            t0 = time.perf_counter()
            o = llm.chat([c], [p])[0]
            sync()
            wall += time.perf_counter() - t0
            steps += o.stats.target_calls
            tokens += len(o.token_ids)
            if p.guided is not None and o.finish_reason == "stop":
                ended += 1
                valid += matches_guide(p.guided, o.text)
        TreeGuide.masks = masks
        results.append({"check": f"SmolLM2 json_tasks batch 1, {mode}", "host_masks_ms_per_step":
                        round(mask_s[0] * 1e3 / steps, 4), "speculation": llm.engine.tree.name,
                        "prompts": len(chats), "tokens": tokens, "decode_steps": steps,
                        "ms_per_token": round(wall * 1e3 / tokens, 4), "ms_per_step": round(wall * 1e3 / steps, 4),
                        "tpc": round(tokens / steps, 3), "first_request_s": round(warm, 3), "guided_ended": ended, "guided_valid": valid,
                        "guided_graphs": len(getattr(llm.engine.runner.graphs, "guided", {}) or {})})
        print(json.dumps(results[-1]), flush=True)


def main() -> int:
    results = []
    if os.environ.get("TINY") == "0":  # check 4 only
        smollm2(results, torch.cuda.synchronize if DEV == "cuda" else (lambda: None))
        return finish(results)
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
    # step times at batch 1: the same prompt free (graphed steps), guided (three graphs a step), guided eagerly
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    for name, g, eager in (("free", None, False), ("guided regex, graphs", GuidedDecoding(regex=r"[a-z ]{5,400}\."),
                                                     False),
                           ("guided regex, eager", GuidedDecoding(regex=r"[a-z ]{5,400}\."), True)):
        llm = LLM(target, device=DEV, dtype="float32", draft=draft, speculation="tree:8", cuda_graphs="auto")
        if eager:
            eager_guided(llm)
        sp = SamplingParams(max_tokens=200, guided=g, ignore_eos=True)
        wall, (o,) = timed(llm, ["Hello there"], [sp], sync)
        results.append({"check": f"batch-1 step time, {name}", "ms_per_step": round(wall * 1e3 / o.stats.target_calls,
                                                                                    3),
                        "tokens": len(o.token_ids), "steps": o.stats.target_calls})
        if not eager:
            ref = o.token_ids
        else:
            results.append({"check": "guided regex: graphs == eager", "ok": o.token_ids == ref})
    if os.environ.get("SMOLLM2"):
        smollm2(results, sync)
    return finish(results)


def finish(results) -> int:
    for r in results:
        print(json.dumps(r), flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "guided_disagg_gpu.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("ok", True) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
