"""`eyas make-distill-data`: regenerate the assistant turns of a conversation set with the target itself.

The draft then learns the target's own text rather than ShareGPT's (EAGLE-3 and HASS report higher acceptance this
way). Conversations are processed in batches through the offline `LLM` API: round r generates the r-th assistant
turn of every conversation of the batch at once, from the user turns and the *regenerated* earlier answers.
A conversation stops early when its next prompt would not fit the context with `max_tokens` to spare.
The output has the input's layout (`{"id", "conversations": [...]}`) plus `"regenerated_by"`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm.auto import tqdm

from eyas.train.data import normalize_messages, open_text, read_jsonl


def regenerate(llm, conversations: list[list[dict]], params, max_turns: int | None = None,
               max_prompt_tokens: int | None = None, stats: dict | None = None) -> list[list[dict]]:
    """New conversations, aligned with the input: the same user (and system) turns, each assistant turn generated
    by `llm`; None where not even the first turn fits. `params`: one SamplingParams, or one per conversation.
    `stats` (optional) accumulates "prompt_tokens" and "generated_tokens"."""
    tok = llm.tokenizer
    users = []
    for conv in conversations:
        system = [m for m in conv[:1] if m["role"] == "system"]
        u = [m for m in conv if m["role"] == "user"]
        users.append((system, u[:max_turns] if max_turns else u))
    histories = [list(system) for system, _ in users]
    alive = [True] * len(conversations)
    plist = params if isinstance(params, list) else [params] * len(conversations)
    limit = llm.engine.max_model_len - max(p.max_tokens for p in plist) - 8
    if max_prompt_tokens:
        limit = min(limit, max_prompt_tokens)
    rounds = max((len(u) for _, u in users), default=0)
    for r in range(rounds):
        idx, prompts = [], []
        for i, (_, u) in enumerate(users):
            if not alive[i] or r >= len(u):
                continue
            msgs = histories[i] + [u[r]]
            ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_bos=False)
            if len(ids) > limit:
                alive[i] = False
                continue
            idx.append(i)
            prompts.append(ids)
        if not prompts:
            break
        outs = llm.generate(prompts, [plist[i] for i in idx])
        for i, o in zip(idx, outs):
            histories[i] += [users[i][1][r], {"role": "assistant", "content": o.text}]
            if stats is not None:
                stats["prompt_tokens"] = stats.get("prompt_tokens", 0) + len(o.prompt_token_ids)
                stats["generated_tokens"] = stats.get("generated_tokens", 0) + len(o.token_ids)
    return [h if any(m["role"] == "assistant" for m in h) else None for h in histories]


def make_distill_data(model: str, data: list[str], out: str, max_tokens: int = 512, temperature: float = 0.0,
                      batch_size: int = 64, limit: int | None = None, max_turns: int | None = None,
                      device: str = "auto", dtype: str = "auto", draft: str | None = None,
                      speculation: str | None = None, seed: int = 0, progress: bool = True,
                      time_budget: float | None = None, max_prompt_tokens: int | None = None,
                      chunk: int | None = None, cuda_graphs: bool | None = None,
                      max_num_batched_tokens: int | None = None, min_admit: int | None = None) -> dict:
    """Regenerate `data` into `out`. `batch_size` requests decode together (continuous batching over chunks of
    `chunk` conversations, default 4 x batch_size, so the batch stays full while stragglers finish); CUDA graphs are
    used on a GPU. `time_budget` (seconds): start no new chunk after that; what is done is written.
    Prefill steps come in few, large batches: `min_admit` (default batch_size // 4) places must be free before
    waiting requests join the batch, and a prefill step takes up to `max_num_batched_tokens` tokens (default
    max(2048, 64 x batch_size)). Prefill steps are eager forwards: at batch 256 on the H200, admitting each request
    at once with 4096 tokens a step spent 27 of 41 s in 530 prefill steps of 12 sequences; these defaults (64,
    16384), 16 of 36 s in 140 steps of 73, and generated 1.8x the tokens a second (docs/benchmarks.md, "Session
    46"). So a wave is not cut at the prefill graphs' 16 sequences a step (`EngineConfig.max_prefill_seqs`), which
    a server's waves are."""
    from eyas import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, device=device, dtype=dtype, draft=draft, speculation=speculation, max_num_seqs=batch_size,
              max_num_batched_tokens=max(2048, 64 * batch_size) if max_num_batched_tokens is None
              else max_num_batched_tokens,
              min_admit=max(1, batch_size // 4) if min_admit is None else min_admit,
              cuda_graphs="auto" if cuda_graphs is None else cuda_graphs,
              max_prefill_seqs=0)  # its waves whole, as session 46 measured them (not a server's 16 a step)
    if llm.tokenizer is None or not llm.tokenizer.chat_template:
        raise ValueError(f"model {model!r} has no chat template: it cannot regenerate conversations")
    records = []
    for rec in read_jsonl(data):
        msgs = normalize_messages(rec, need_assistant=False)
        if msgs and any(m["role"] == "user" for m in msgs):
            records.append((rec.get("id", len(records)), msgs))
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise ValueError(f"no conversation with a user turn in {data}")
    chunk = chunk or 4 * batch_size
    written = turns = 0
    stats: dict = {}
    stopped = None
    t_gen = time.perf_counter()
    bar = tqdm(total=len(records), desc="regenerating", unit="conv", disable=not progress)
    # each chunk's lines are written (and, for .gz / .xz, compressed: xz took ~8% of a batch-256 run's time, session
    # 46's cProfile) by one background thread while the next chunk generates; the compressors release the GIL
    with open_text(out, "w") as f, ThreadPoolExecutor(max_workers=1) as writer:
        pending = None
        for start in range(0, len(records), chunk):
            if time_budget is not None and time.perf_counter() - t_gen >= time_budget:
                stopped = f"time_budget={time_budget}s"
                break
            part = records[start: start + chunk]
            # one seed per conversation: counter-based sampling keyed by (seed, position) would otherwise give
            # every conversation the same random numbers at the same positions
            params = [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                     seed=(seed * 1_000_003 + start + j) % (2 ** 63) if temperature > 0 else None)
                      for j in range(len(part))]
            new = regenerate(llm, [m for _, m in part], params, max_turns, max_prompt_tokens, stats)
            lines = []
            for (rid, _), conv in zip(part, new):
                if conv is None:
                    continue
                lines.append(json.dumps({"id": rid, "conversations": conv, "regenerated_by": model,
                                         "temperature": temperature, "max_tokens": max_tokens}, ensure_ascii=False))
                written += 1
                turns += sum(m["role"] == "assistant" for m in conv)
            if pending is not None:
                pending.result()  # in order, and a failed write stops the run here
            pending = writer.submit(f.write, "".join(x + "\n" for x in lines))
            bar.update(len(part))
            bar.set_postfix(tok_s=f"{stats.get('generated_tokens', 0) / (time.perf_counter() - t_gen):,.0f}",
                            refresh=False)
        if pending is not None:
            pending.result()
    bar.close()
    gen_s = time.perf_counter() - t_gen
    return {"conversations": written, "assistant_turns": turns, "read": len(records),
            "generated_tokens": stats.get("generated_tokens", 0), "prompt_tokens": stats.get("prompt_tokens", 0),
            "generation_seconds": round(gen_s, 1),
            "generated_tokens_per_second": round(stats.get("generated_tokens", 0) / max(gen_s, 1e-9), 1),
            "seconds": round(time.perf_counter() - t0, 1), "stopped": stopped,
            "cuda_graphs": llm.engine.config.cuda_graphs,
            "out": str(out)}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `make-distill-data` on the eyas CLI's subparsers."""
    p = subparsers.add_parser("make-distill-data", help="regenerate assistant turns with the target itself",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", nargs="+", required=True, help="jsonl[.gz|.xz] conversation files")
    p.add_argument("--out", required=True, help="output .jsonl, .jsonl.gz or .jsonl.xz")
    p.add_argument("--max-tokens", type=int, default=512, help="new tokens per assistant turn")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=64, help="conversations generated together")
    p.add_argument("--limit", type=int, default=None, help="the first N conversations only")
    p.add_argument("--max-turns", type=int, default=None, help="regenerate at most N turns per conversation")
    p.add_argument("--draft", default=None, help="speed generation up with this EAGLE draft (or 'default')")
    p.add_argument("--speculation", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: start no new chunk after that (what is done is written)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="skip turns whose prompt is longer")
    p.add_argument("--chunk", type=int, default=None, help="conversations per engine call (default 4 x batch)")
    p.add_argument("--min-admit", type=int, default=None,
                   help="free places in the batch before waiting requests join it (default batch / 4)")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="tokens a prefill step takes (default max(2048, 64 x batch))")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    for name in ("max_tokens", "batch_size", "min_admit", "max_batched_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    info = make_distill_data(args.model, args.data, args.out, args.max_tokens, args.temperature, args.batch_size,
                             args.limit, args.max_turns, args.device, args.dtype, args.draft, args.speculation,
                             args.seed, time_budget=args.time_budget, max_prompt_tokens=args.max_prompt_tokens,
                             chunk=args.chunk, progress=args.progress, min_admit=args.min_admit,
                             max_num_batched_tokens=args.max_batched_tokens)
    print(json.dumps(info))
    return 0


def main(argv=None) -> int:
    from eyas.cli import subcommand_main
    return subcommand_main(add_parser, "make-distill-data", "eyas.train.distill_data", argv)


if __name__ == "__main__":
    sys.exit(main())
