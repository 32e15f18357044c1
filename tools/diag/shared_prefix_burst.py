"""Requests that arrive together and begin alike, with and without waiting for a shared prefix
(`eyas.engine.scheduler.SHARE_MIN_TOKENS`; "off" sets it out of reach): prompt tokens found cached, the mean time to
first token and the wall time of the whole batch.

Two workloads, greedy, `--max-tokens` each: "burst", `--requests` MT-Bench first turns behind one long system prompt
(the first `--system-tokens` tokens of the MT-Bench questions, joined), all at once; "n", `--choices` choices
(sampled, T=0.8) of each of a few such prompts.

    PYTHONPATH=. python3 tools/diag/shared_prefix_burst.py --prompts question.jsonl [--device cpu] [--out rows.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_rows import chat_prompts, emit, save  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--speculation", default="chain:3")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import eyas.engine.scheduler as scheduler
    from eyas import LLM, SamplingParams
    from eyas.bench.tpc import read_prompts

    records = read_prompts(args.prompts)
    llm = LLM(args.model, device=args.device, draft=args.draft, speculation=args.speculation)
    tok = llm.tokenizer
    system = tok.decode(tok.encode(" ".join(r["text"] for r in records))[: args.system_tokens])
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": r["text"]}]
             for r in records[-args.requests:]]
    prompts = [tok.encode(tok.apply_chat_template(c)) for c in convs]
    workloads = {
        "burst": (prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)),
        "n": ([p for p in prompts[: max(1, args.requests // args.choices)] for _ in range(args.choices)],
              SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.8, seed=0)),
    }
    default = scheduler.SHARE_MIN_TOKENS
    rows = []
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    for name, (ps, params) in workloads.items():
        for wait in (False, True, False, True):
            llm.engine.scheduler.reset_prefix_cache()
            scheduler.SHARE_MIN_TOKENS = default if wait else 1 << 40
            try:
                t0 = time.perf_counter()
                outs = llm.generate(ps, params)
                wall = time.perf_counter() - t0
            finally:
                scheduler.SHARE_MIN_TOKENS = default
            ttft = [o.ttft for o in outs]
            row = dict(workload=name, wait=wait, requests=len(ps), prompt_tokens=sum(len(p) for p in ps),
                       cached_tokens=sum(o.num_cached_tokens for o in outs),
                       mean_ttft_ms=round(1e3 * sum(ttft) / len(ttft), 1), wall_s=round(wall, 3))
            emit(rows, row)
    save(args.out, args, rows)


if __name__ == "__main__":
    main()
