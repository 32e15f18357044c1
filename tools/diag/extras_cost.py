"""What requests that ask for log-probabilities or penalties cost their batch: ms per output token of a batch of B
MT-Bench first turns (greedy, `--max-tokens` each, end-of-sequence ignored), decoded with no such request ("free"),
with one request of the batch asking for log-probabilities (k = 5), for penalties (repetition 1.2, frequency 0.3), or
for both, and every request asking for both ("all"); "words" is the penalties' request with bad words of several
tokens too (their matching: `Penalties.kind` 2's graphs), and "words_all" every request so. On CUDA each row runs with graphs ("graphed": such steps replay
the graphs of `GraphedStep.launch_extras`) and without ("eager": every step eager, which is what a batch with such a
request cost before those graphs). A record of costs, not a fast path.

    PYTHONPATH=. python3 tools/diag/extras_cost.py --prompts question.jsonl [--batch-sizes 1,8,32] \\
        [--max-tokens 128] [--speculation tree:smollm2_48d5] [--repeat 2] [--out extras.json]

Prints one line per row and writes the rows as JSON: the best of `--repeat` timed runs (wall time of `generate`
over the whole batch, prefill included, divided by `--max-tokens`), after one untimed run of the same batch (it
captures the graphs the row needs).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_rows import chat_prompts, emit, save  # noqa: E402

KINDS = {"free": (), "logprobs": ("lp",), "penalties": ("pen",), "both": ("lp", "pen"), "all": ("lp", "pen"),
         "words": ("pen", "words"), "words_all": ("pen", "words")}
WORDS = ["in conclusion", "the capital of", "I think that", "as an AI", "it is important to note"]


def params_for(kind: str, B: int, max_tokens: int):
    from eyas import SamplingParams
    base = dict(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    extra = {}
    if "lp" in KINDS[kind]:
        extra["logprobs"] = 5
    if "pen" in KINDS[kind]:
        extra.update(repetition_penalty=1.2, frequency_penalty=0.3)
    if "words" in KINDS[kind]:
        extra["bad_words"] = WORDS
    asking = B if kind.endswith("all") else (1 if extra else 0)
    return [SamplingParams(**base, **(extra if i < asking else {})) for i in range(B)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--speculation", default="tree:smollm2_48d5", help="a preset, or auto (the draft's dispatcher)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--modes", default="graphed,eager", help="graphed (CUDA only), eager")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from eyas import LLM
    from eyas.bench.tpc import read_prompts

    records = read_prompts(args.prompts)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for mode in args.modes.split(","):
        llm = LLM(args.model, device=args.device, draft=args.draft,
                  speculation=None if args.speculation == "auto" else args.speculation,
                  cuda_graphs=mode == "graphed", prefix_caching=False, max_num_seqs=max(sizes))
        tok = llm.tokenizer
        prompts = chat_prompts(tok, records)
        for B in sizes:
            batch = (prompts * B)[:B]
            for kind in args.kinds.split(","):
                params = params_for(kind, B, args.max_tokens)
                llm.generate(batch, params)  # captures the graphs this row needs
                best = float("inf")
                for _ in range(args.repeat):
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    outs = llm.generate(batch, params)
                    best = min(best, time.perf_counter() - t0)
                tpc = sum(len(o.token_ids) for o in outs) / max(1, sum(o.stats.target_calls for o in outs))
                row = dict(mode=mode, batch=B, kind=kind, ms_per_token=round(1e3 * best / args.max_tokens, 4),
                           tpc=round(tpc, 3))
                emit(rows, row)
        del llm
    save(args.out, args, rows, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
