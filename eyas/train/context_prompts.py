"""`eyas make-context-prompts`: user prompts that hand the model a passage and a task on it, for draft training.

A draft misses most where the target copies from its prompt: names, figures and phrases of a passage it was asked to
extract from, summarise or rewrite (the shipped SmolLM2 draft's misses at tokens the target was > 99% sure of were
half copies from the prompt on MT-Bench). Self-written prompts (`eyas make-prompts`) are short and hold no such
passages. Here each prompt is a task template (one line of `--templates`, with `{text}` where the passage goes)
filled with a passage taken from the assistant turns of conversation files (the ShareGPT layout): prompt i uses
template i mod n and a passage drawn by (seed, i) alone, so the output does not depend on anything else.
`eyas make-distill-data` then has the target answer them.

Passages: assistant turns of `min_words`..`max_words` words, each used at most once. The output has the ShareGPT
layout (`{"id", "conversations": [{"role": "user", ...}]}`) with `"template"` (its index) and `"passage_of"` (the id
of the record the passage came from).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tqdm.auto import tqdm

from eyas.train.data import normalize_messages, open_text, read_jsonl, read_lines


def read_templates(path: str | Path) -> list[str]:
    """Templates, one a line ('#' lines and blank ones skipped); a literal "\\n" in a line is a line break."""
    out = [ln.replace("\\n", "\n") for ln in read_lines(path, "--templates", "templates")]
    for i, t in enumerate(out):
        if t.count("{text}") != 1:
            raise ValueError(f"--templates {str(path)!r}: template {i} must hold '{{text}}' exactly once: {t!r}")
    return out


def passages(paths, min_words: int, max_words: int) -> list[tuple[str, str]]:
    """(record id, passage) for every assistant turn of `min_words`..`max_words` words, in file order, first
    occurrence of each text only."""
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= --min-words <= --max-words, got {min_words} and {max_words}")
    seen: set[str] = set()
    out = []
    for n, rec in enumerate(read_jsonl(paths)):
        msgs = normalize_messages(rec)
        for m in msgs or []:
            text = m["content"].strip()
            if m["role"] != "assistant" or text in seen or not min_words <= len(text.split()) <= max_words:
                continue
            seen.add(text)
            out.append((str(rec.get("id", n)), text))
    return out


def make_context_prompts(data, templates: list[str], num: int, out: str, seed: int = 0, min_words: int = 40,
                         max_words: int = 250, progress: bool = True) -> dict:
    if num < 1:
        raise ValueError(f"--num must be >= 1, got {num}")
    pool = passages(data, min_words, max_words)
    if len(pool) < num:
        raise ValueError(f"the data has {len(pool)} usable passages ({min_words}-{max_words} words); --num asks {num}")
    order = random.Random(seed).sample(range(len(pool)), num)  # each passage at most once
    with open_text(out, "w") as f:
        for i, k in enumerate(tqdm(order, desc="writing prompts", unit="prompt", disable=not progress)):
            rid, text = pool[k]
            t = i % len(templates)
            rec = {"id": f"ctx-{seed}-{i}",
                   "conversations": [{"role": "user", "content": templates[t].replace("{text}", text)}],
                   "template": t, "passage_of": rid}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return {"prompts": num, "passages": len(pool), "templates": len(templates), "out": str(out)}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `make-context-prompts` on the eyas CLI's subparsers."""
    p = subparsers.add_parser("make-context-prompts", help="prompts of a task on a passage (extract, summarise, ...)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", required=True,
                   help="conversation files (.jsonl[.gz|.xz]) to take passages from")
    p.add_argument("--templates", required=True,
                   help="a text file of task templates, one a line, each with {text} where the passage goes")
    p.add_argument("--num", type=int, required=True, help="prompts to write")
    p.add_argument("--out", required=True, help="output .jsonl[.gz|.xz] (the ShareGPT layout)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-words", type=int, default=40)
    p.add_argument("--max-words", type=int, default=250)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    info = make_context_prompts(args.data, read_templates(args.templates), args.num, args.out, args.seed,
                                args.min_words, args.max_words, args.progress)
    print(json.dumps(info))
    return 0


def main(argv=None) -> int:
    from eyas.cli import subcommand_main
    return subcommand_main(add_parser, "make-context-prompts", "eyas.train.context_prompts", argv)


if __name__ == "__main__":
    raise SystemExit(main())
