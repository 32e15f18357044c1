"""Does the trainer's view of the draft predict what the engine accepts? `chain:3` at T=0 through the engine (CPU,
float32), then the same acceptance replayed from the trainer's unrolled, teacher-forced draft streams
(`eyas.train.trainer.unrolled_streams`) over the engine's own output: depth d of the step rooted at r accepts when
stream d's top-1 at r + d - 1 is the next token, as long as depths 1..d-1 did. Equal TPC means nothing is lost
between the training loss and decoding. Used in session 23 (docs/draft-training.md, "Run N": 2.2306 both).
    PYTHONPATH=. python3 tools/diag/replay_vs_engine.py PROMPTS.jsonl[.xz] [--num 48] [--max-tokens 64]
        [--draft default]   (the last N records' first user turns; MT-Bench's question.jsonl works too)"""
import argparse

import torch

from eyas import LLM, SamplingParams
from eyas.bench.tpc import read_prompts
from eyas.train.trainer import draft_inputs, unrolled_streams

ap = argparse.ArgumentParser()
ap.add_argument("prompts")
ap.add_argument("--num", type=int, default=48)
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--draft", default="default")
args = ap.parse_args()
convs = [[{"role": "user", "content": r["text"]}] for r in read_prompts(args.prompts)[-args.num:]]
llm = LLM("smollm2", device="cpu", dtype="float32", draft=args.draft, speculation="chain:3")
outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
target, draft = llm.target, llm.draft
calls = committed = 0
with torch.no_grad():
    for o in outs:
        ids = torch.tensor([list(o.prompt_token_ids) + list(o.token_ids)])
        P, n = len(o.prompt_token_ids), len(o.token_ids)
        amask = torch.zeros_like(ids, dtype=torch.bool)
        amask[:, P:] = True
        emb, feats, pos, _, _ = draft_inputs(target, ids, amask, draft.feature_layers)
        streams = unrolled_streams(draft, emb, feats, pos, 3)
        nxt = ids[0, 2:]  # stream index p predicts token p + 2
        ok = [target.compute_logits(s[0, : len(nxt)]).argmax(-1) == nxt for s in streams]
        r, done = P - 1, 1  # the prefill commits the first token, at index P; the first step is rooted at P - 1
        while done < n:
            k = 0
            while k < 3 and r + k < len(nxt) and bool(ok[k][r + k]):
                k += 1
            step = min(k + 1, n - done)
            calls, committed, done, r = calls + 1, committed + step, done + step, r + step
eng_calls = sum(o.stats.target_calls for o in outs)
eng_committed = sum(o.stats.committed for o in outs)
print(f"engine: TPC {eng_committed / eng_calls:.4f} ({eng_committed} tokens, {eng_calls} calls)")
print(f"replay: TPC {committed / calls:.4f} ({committed} tokens, {calls} calls)")
