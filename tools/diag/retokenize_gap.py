"""How far is the text that `eyas make-distill-data` stores from the tokens the model wrote? SmolLM2 answers the
MT-Bench first turns greedily (float32 on the CPU, as `eyas bench tpc` prompts them), and each answer's token ids are
compared with its text tokenised again (the end-of-turn token left aside: the chat template adds it back).
    PYTHONPATH=. python3 tools/diag/retokenize_gap.py [--max-tokens 128] [--limit N]   (from the repository root)
Session 25 (2026-12-02): 3 of 80 answers differ (docs/draft-training.md, "Regenerated data")."""
import argparse
import json

from eyas import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", default="../shared/data/mt_bench/question.jsonl")
ap.add_argument("--max-tokens", type=int, default=128)
ap.add_argument("--limit", type=int, default=None)
args = ap.parse_args()
questions = [json.loads(line) for line in open(args.prompts)][: args.limit]
llm = LLM("smollm2", device="cpu", dtype="float32")
tok = llm.tokenizer
prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}]) for q in questions]
outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
total = differ = 0
for o in outs:
    ids = list(o.token_ids)
    if ids and ids[-1] == tok.eos_token_id:
        ids = ids[:-1]
    again = tok.encode(tok.decode(ids))
    total += len(ids)
    if again != ids:
        differ += 1
        k = next((i for i, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))
        print(f"answer of {len(ids)} tokens differs at token {k}: {tok.decode(ids[max(0, k - 3):k + 3])!r} "
              f"written {ids[max(0, k - 3):k + 3]}, read back {again[max(0, k - 3):k + 3]}")
print(f"{differ} of {len(outs)} answers differ ({total} tokens)")
