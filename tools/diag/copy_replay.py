"""Would copying from the context help the draft? Replays `chain:3` at T=0 over SmolLM2's own greedy answers with
proposals from the draft's teacher-forced streams (`eyas.train.trainer.unrolled_streams`, as
`replay_vs_engine.py`), from an n-gram lookup in the context (prompt lookup: the last n tokens found earlier in the
prompt or the answer, the token that followed them proposed), and from rules that mix the two at each depth.

A replay is exact for any deterministic proposer: a depth is reached only when every shallower proposal equalled
the committed token, so the draft's streams, fed the committed tokens, are what the engine's draft would see.

    PYTHONPATH=. python3 tools/diag/copy_replay.py [--prompts question.jsonl] [--num 80] [--max-tokens 128]
        [--draft default] [--cache answers.json]   (the answers are written there, and read back when it exists)"""
import argparse
import json
from pathlib import Path

import torch

from eyas import LLM, SamplingParams
from eyas.bench.tpc import DEFAULT_PROMPTS, read_prompts
from eyas.train.trainer import draft_inputs, unrolled_streams

DEPTH = 3


def ngram_next(ids: list[int], j: int, n: int) -> int | None:
    """The token that followed the latest earlier occurrence of ids[j-n:j] within ids[:j], or None."""
    if j < n + 1:
        return None
    key = ids[j - n:j]
    for s in range(j - n - 1, -1, -1):
        if ids[s:s + n] == key:
            return ids[s + n]
    return None


def longest_match(ids: list[int], j: int, max_n: int) -> tuple[int, int | None]:
    """(n, token): the longest n <= max_n whose suffix occurs earlier, and the token after it; (0, None) if none."""
    for n in range(max_n, 0, -1):
        t = ngram_next(ids, j, n)
        if t is not None:
            return n, t
    return 0, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--num", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--max-n", type=int, default=6)
    args = ap.parse_args()
    recs = read_prompts(args.prompts)[: args.num]
    llm = LLM("smollm2", device="cpu", dtype="float32", draft=args.draft, speculation="chain:3")
    if args.cache and Path(args.cache).exists():
        answers = json.loads(Path(args.cache).read_text())
    else:
        convs = [[{"role": "user", "content": r["text"]}] for r in recs]
        outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
        answers = [{"prompt": list(o.prompt_token_ids), "answer": list(o.token_ids), "category": r["category"]}
                   for o, r in zip(outs, recs)]
        if args.cache:
            Path(args.cache).write_text(json.dumps(answers))
    target, draft = llm.target, llm.draft

    # per answer: for every token index j of the answer but its first, the draft's depth-d proposal and its prob
    rows = []
    with torch.no_grad():
        for a in answers:
            ids = a["prompt"] + a["answer"]
            t = torch.tensor([ids])
            P = len(a["prompt"])
            amask = torch.zeros_like(t, dtype=torch.bool)
            amask[:, P:] = True
            emb, feats, pos, _, _ = draft_inputs(target, t, amask, draft.feature_layers)
            streams = unrolled_streams(draft, emb, feats, pos, DEPTH)
            props, probs = [], []
            for s in streams:
                p = target.compute_logits(s[0]).float().softmax(-1)
                pr, tok = p.max(-1)
                props.append(tok.tolist())
                probs.append(pr.tolist())
            # the lookup's (match length, token) for every answer token: it depends on the committed text alone
            look = {j: longest_match(ids, j, args.max_n) for j in range(P + 1, len(ids))}
            rows.append((ids, P, props, probs, look))

    def replay(choose) -> float:
        """TPC of `chain:3` where choose(ids, j, draft_tok, draft_p, (match_len, match_tok)) proposes token j (None:
        no proposal)."""
        calls = committed = 0
        for ids, P, props, probs, look in rows:
            n = len(ids) - P
            last, done = P, 1  # the prefill commits the answer's first token, at index P
            while done < n:
                k = 0
                while k < DEPTH:
                    j = last + 1 + k  # the token that depth k + 1 proposes; stream k predicts token p + k + 2 at p
                    if j >= len(ids):
                        break
                    p = j - k - 2
                    tok = choose(ids, j, props[k][p + k], probs[k][p + k], look[j])
                    if tok != ids[j]:
                        break
                    k += 1
                step = min(k + 1, n - done)
                calls, committed, done, last = calls + 1, committed + step, done + step, last + step
        return committed / calls

    def rule(m, tau=1.1):
        def choose(ids, j, dt, dp, match):
            return match[1] if match[0] >= m and dp < tau else dt
        return choose

    def lookup_only(m):
        def choose(ids, j, dt, dp, match):
            return match[1] if match[0] >= m else None
        return choose

    print(f"{len(rows)} answers, {sum(len(r[0]) - r[1] for r in rows)} tokens")
    print(f"draft only      TPC {replay(lambda ids, j, dt, dp, match: dt):.4f}")
    for m in (1, 2, 3, 4):
        print(f"n-gram only m>={m}  TPC {replay(lookup_only(m)):.4f}")
    for m in (2, 3, 4, 5):
        for tau in (1.1, 0.9, 0.7, 0.5):
            print(f"copy if n>={m} and draft p<{tau}: TPC {replay(rule(m, tau)):.4f}")

    def oracle(ids, j, dt, dp, match):
        return ids[j] if ids[j] in (dt, match[1]) else dt
    print(f"either (upper bound of a 2-wide chain) TPC {replay(oracle):.4f}")


if __name__ == "__main__":
    main()
