"""`eyas make-prompts`: user prompts written by the target itself (Magpie-style self-instruct), for draft training.

A chat model given only the text that opens a user turn of its chat template (the "pre-query" text: the default system
turn, then `<|im_start|>user\\n` for SmolLM2) writes a user request of the kind it was instruction-tuned on, and ends
the turn with its end-of-turn token. Sampled at temperature 1, these prompts cover the requests the target's own
training taught it to expect; `eyas make-distill-data` then regenerates the answers, so the draft learns the target's
text on prompts from the target's own instruction distribution (the shipped SmolLM2 draft accepts 0.64 at depth 1 on
ShareGPT first turns but 0.55 on MT-Bench's: the prompt distribution matters).

`--openings FILE` steers the kinds of request: request i starts with opening i mod n (one line of FILE each, e.g.
"Write a persuasive", "Imagine you are", "Solve for x:"); the model writes the rest, and the kept prompt is the
opening plus what it wrote. Without openings the model's own instruction distribution is sampled; the shipped
draft, trained on such prompts, accepts ~0.09 more at depth 1 on unseen ones than on MT-Bench's first turns
(docs/benchmarks.md, "Where the draft misses"), so openings of the kinds of task a benchmark asks (writing,
role-play, reasoning, math, coding, extraction, STEM, humanities) move the data towards them.

Kept: turns the model ended itself (not cut at `max_tokens`), of at least `min_chars` characters, seen once (exact
duplicates dropped). The output has the ShareGPT layout (`{"id", "conversations": [{"role": "user", ...}]}`) with
`"generated_by"` and the request's `"seed"` (the same model, sampling settings and seed write the same prompt again).
"""
from __future__ import annotations

import argparse
import json
import time

from tqdm.auto import tqdm

from eyas.train.data import open_text, read_lines

_SENTINEL = "\x00eyas-user-request\x00"


def pre_query_text(tokenizer) -> str:
    """The rendered chat up to where a first user request's text starts (system turn included if the template adds
    one by default)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template: it cannot write user prompts")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not render the user's text verbatim")
    return text[: text.index(_SENTINEL)]


def keep_prompt(text: str, finish_reason: str | None, min_chars: int) -> str | None:
    """The prompt to keep, stripped, or None: the model must have ended the turn itself (`finish_reason == "stop"`)."""
    text = text.strip()
    if finish_reason != "stop" or len(text) < min_chars:
        return None
    return text


def make_prompts(model: str, num: int, out: str, temperature: float = 1.0, top_p: float = 0.95,
                 max_tokens: int = 160, min_chars: int = 16, batch_size: int = 256, seed: int = 0,
                 time_budget: float | None = None, device: str = "auto", dtype: str = "auto",
                 progress: bool = True, openings: list[str] | None = None) -> dict:
    """Write up to `num` distinct self-written user prompts to `out` (.jsonl, .jsonl.gz or .jsonl.xz). Requests go to
    the engine in chunks of 4 x batch_size (fewer towards the end: twice the prompts still missing, and never past
    8 x num tried) with one seed each (`seed`-derived), until `num` are kept, 8 x num have been tried, or
    `time_budget` seconds have passed (what is kept so far is written). Request i's seed and opening depend on i
    alone, so the prompts do not depend on `batch_size`. `openings`: request i's user text starts with
    openings[i % len(openings)], which the kept prompt includes."""
    from eyas import LLM, SamplingParams

    if num < 1 or batch_size < 1 or max_tokens < 1:
        raise ValueError("--num, --batch-size and --max-tokens must be >= 1")
    t0 = time.perf_counter()
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=batch_size,
              max_num_batched_tokens=max(2048, 16 * batch_size))
    if llm.tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer")
    if openings is not None and (not openings or any(not o.strip() for o in openings)):
        raise ValueError("openings must be a non-empty list of non-blank texts")
    pre = pre_query_text(llm.tokenizer)
    opens = openings or [""]
    prefixes = [llm.tokenizer.encode(pre + o) for o in opens]
    seen: set[str] = set()
    tried = generated = 0
    stopped = None
    bar = tqdm(total=num, desc="writing prompts", unit="prompt", disable=not progress)
    t_gen = time.perf_counter()
    with open_text(out, "w") as f:
        while len(seen) < num:
            if tried >= 8 * num:
                stopped = f"tried {tried} requests"
                break
            if time_budget is not None and time.perf_counter() - t_gen >= time_budget:
                stopped = f"time_budget={time_budget}s"
                break
            chunk = min(4 * batch_size, 8 * num - tried, 2 * (num - len(seen)))
            params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                     seed=(seed * 1_000_003 + tried + j) % (2 ** 63)) for j in range(chunk)]
            which = [(tried + j) % len(opens) for j in range(chunk)]
            outs = llm.generate([prefixes[w] for w in which], params)
            tried += chunk
            for sp, o, w in zip(params, outs, which):
                generated += len(o.token_ids)
                text = keep_prompt(opens[w] + o.text, o.finish_reason, min_chars)
                if text is None or text in seen or len(seen) >= num:
                    continue
                seen.add(text)
                rec = {"id": f"self-{seed}-{len(seen) - 1}", "conversations": [{"role": "user", "content": text}],
                       "generated_by": model, "seed": sp.seed}
                if openings:
                    rec["opening"] = opens[w]
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                bar.update(1)
            bar.set_postfix(kept=f"{len(seen) / tried:.0%}", refresh=False)
    bar.close()
    gen_s = time.perf_counter() - t_gen
    return {"prompts": len(seen), "tried": tried, "kept_fraction": round(len(seen) / max(tried, 1), 3),
            "generated_tokens": generated, "generation_seconds": round(gen_s, 1),
            "generated_tokens_per_second": round(generated / max(gen_s, 1e-9), 1),
            "seconds": round(time.perf_counter() - t0, 1), "stopped": stopped, "out": str(out)}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `make-prompts` on the eyas CLI's subparsers."""
    p = subparsers.add_parser("make-prompts", help="user prompts written by the target itself (self-instruct)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num", type=int, required=True, help="distinct prompts to write")
    p.add_argument("--out", required=True, help="output .jsonl[.gz|.xz] (the ShareGPT layout)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=160, help="longest prompt; longer ones are dropped")
    p.add_argument("--min-chars", type=int, default=16, help="shortest prompt kept")
    p.add_argument("--batch-size", type=int, default=256, help="requests decoded together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None, help="seconds: stop after that (what is kept is written)")
    p.add_argument("--openings", default=None,
                   help="a text file of user-turn openings, one per line ('#' lines and blank ones skipped): request "
                        "i starts with opening i mod n, and the model writes the rest")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    openings = read_lines(args.openings, "--openings", "openings") if args.openings else None
    info = make_prompts(args.model, args.num, args.out, args.temperature, args.top_p, args.max_tokens, args.min_chars,
                        args.batch_size, args.seed, args.time_budget, args.device, args.dtype, args.progress,
                        openings)
    print(json.dumps(info))
    return 0


def main(argv=None) -> int:
    from eyas.cli import subcommand_main
    return subcommand_main(add_parser, "make-prompts", "eyas.train.self_instruct", argv)

if __name__ == "__main__":
    raise SystemExit(main())
