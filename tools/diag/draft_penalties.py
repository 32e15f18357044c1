"""TPC under repetition penalties with the draft proposing from penalised logits (`eyas.spec.step.PENALISE_DRAFT`)
and without, on MT-Bench first turns (greedy); the outputs must be the same either way.

    PYTHONPATH=. python3 tools/diag/draft_penalties.py --prompts question.jsonl [--limit 8] [--max-tokens 64] \\
        [--speculation chain:3,tree:smollm2_48d5] [--device cpu] [--out rows.json]

One row per (speculation, penalties): TPC off -> on. A record, not a test.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_rows import chat_prompts, emit, save  # noqa: E402

SETTINGS = {"repetition 1.2": dict(repetition_penalty=1.2), "frequency 0.5": dict(frequency_penalty=0.5),
            "presence 0.5 + frequency 0.3": dict(presence_penalty=0.5, frequency_penalty=0.3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--speculation", default="chain:3,tree:smollm2_48d5")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import eyas.spec.step as step
    from eyas import LLM, SamplingParams
    from eyas.bench.tpc import read_prompts

    records = read_prompts(args.prompts, args.limit)
    rows = []
    for spec in args.speculation.split(","):
        llm = LLM(args.model, device=args.device, draft=args.draft, speculation=spec, prefix_caching=False)
        tok = llm.tokenizer
        prompts = chat_prompts(tok, records)
        for name, pen in [("none", {})] + list(SETTINGS.items()):
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **pen)
            got = {}
            try:
                for on in (False, True):
                    step.PENALISE_DRAFT = on
                    outs = llm.generate(prompts, params)
                    got[on] = ([o.token_ids for o in outs],
                               sum(len(o.token_ids) for o in outs) / sum(o.stats.target_calls for o in outs))
            finally:
                step.PENALISE_DRAFT = True
            row = dict(speculation=spec, penalties=name, tpc_off=round(got[False][1], 3),
                       tpc_on=round(got[True][1], 3), same_outputs=got[False][0] == got[True][0])
            emit(rows, row)
    save(args.out, args, rows)


if __name__ == "__main__":
    main()
