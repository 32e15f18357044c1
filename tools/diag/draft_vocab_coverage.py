"""How much of a held-out text would a draft vocabulary of K tokens cover? Counts the assistant tokens of training data
once (`eyas.spec.draft_vocab.count_assistant_tokens`), picks the K most frequent for several K
(`select_draft_vocab`, as `eyas make-draft-vocab` does), and reports each vocabulary's coverage of the data itself
and of held-out answers: a jsonl of {"input_ids", "loss_mask"} or of conversations (the `--eval-data` of `eyas
make-tree`, e.g. SmolLM2's greedy MT-Bench answers). A token outside the vocabulary is one the draft can never propose.
    PYTHONPATH=. python3 tools/diag/draft_vocab_coverage.py --data a.jsonl.xz b.jsonl.xz --eval mt.jsonl \
        --sizes 16384 24576 32768 [--out coverage.json]        (from the repository root; CPU)"""
import argparse
import json
import time

import torch

from eyas.loader.resolve import load_target
from eyas.spec.draft_vocab import count_assistant_tokens, eos_ids, select_draft_vocab
from eyas.train.data import load_examples


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--eval", required=True, help="jsonl of {input_ids, loss_mask} or of conversations")
    ap.add_argument("--sizes", nargs="+", type=int, default=[16384, 24576, 32768])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.time()
    target, tok = load_target(args.model, "cpu", "bfloat16")
    V = target.config.vocab_size
    eos = eos_ids(target, tok)  # as `eyas make-draft-vocab` keeps them
    del target
    counts = count_assistant_tokens(args.data, tok, V, limit=args.limit)
    held = torch.zeros(V, dtype=torch.long)
    for ex in load_examples([args.eval], tok, workers=1):  # input_ids + loss_mask, or conversations (rendered)
        held += torch.bincount(torch.from_numpy(ex.ids[ex.mask].astype("int64")), minlength=V)
    rows = []
    for k in args.sizes:
        ids = select_draft_vocab(counts, k, always=eos)
        rows.append({"size": k, "coverage_data": round(float(counts[ids].sum()) / int(counts.sum()), 6),
                     "coverage_eval": round(float(held[ids].sum()) / int(held.sum()), 6)})
        print(json.dumps(rows[-1]), flush=True)
    res = {"data": args.data, "eval": args.eval, "data_tokens": int(counts.sum()), "eval_tokens": int(held.sum()),
           "distinct_data_tokens": int((counts > 0).sum()), "rows": rows, "seconds": round(time.time() - t0, 1),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.out:
        open(args.out, "w").write(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))


if __name__ == "__main__":
    main()
