"""TTFT of a chat's second turn, whose prompt starts with the first turn's (prefix caching: only what is new is
prefilled, after a cached prefix), against the first turn's, on an engine set up as `eyas serve` sets it up (the
model's whole context, prefix caching on, CUDA graphs captured ahead of time by `capture_all`: the greedy decode
steps' and every prefill's).

MT-Bench's questions have two user turns. Each wave of `--batch` questions runs turn 1 (the first user turn,
`--max-tokens` greedy tokens), then turn 2: the chat template over [turn 1, its answer's text, turn 2]. The prefill
graphs' use is counted by wrapping `PrefillGraphs.run`: replays of a graph captured ahead, graphs captured in the
request's path when a shape is first seen (a chunk after a cached prefix is keyed by its context too), and chunks
that ran eagerly because no graph is kept (`MAX_GRAPHS`) or one failed. Prints one JSON line.

    PYTHONPATH=. python3 tools/diag/turn2_ttft.py --prompts question.jsonl --batch 1 --out /tmp/turn2.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch

import eyas.engine.prefill_graph as pg
from eyas import LLM, SamplingParams


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def instrument() -> Counter:
    """Wrap `PrefillGraphs.run`: counts "replayed" (a graph already there), "captured" (captured now) and "eager"
    (no graph: the caller runs the step eagerly), and each key seen ("key <key>")."""
    counts: Counter = Counter()
    run = pg.PrefillGraphs.run

    def counted(self, packed, key):
        known = key in self.graphs
        out = run(self, packed, key)
        counts["replayed" if known else "eager" if out is None else "captured"] += 1
        counts[f"key {key}"] += 1
        return out

    pg.PrefillGraphs.run = counted
    return counts


def wave_ttft(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    """ms until every request of the wave has its first token, and the finished sequences."""
    _sync()
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=i))
            for i, p in enumerate(prompts)]
    first = None
    while engine.has_unfinished():
        engine.step()
        if first is None and all(s.num_output > 0 for s in seqs):
            _sync()
            first = time.perf_counter()
    return ((first or time.perf_counter()) - t0) * 1e3, seqs


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"mean": round(statistics.fmean(xs), 3), "median": round(statistics.median(xs), 3),
            "p90": round(xs[int(0.9 * (len(xs) - 1))], 3), "max": round(xs[-1], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--draft", default="default")
    p.add_argument("--speculation", default=None, help="default: the draft's own for the device")
    p.add_argument("--prompts", required=True, help="MT-Bench's question.jsonl (two turns a question)")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--batch", type=int, default=1, help="questions a wave")
    p.add_argument("--max-tokens", type=int, default=64, help="turn 1's answer, and turn 2's tokens")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the engine's (the server's default is 64)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    qs = [json.loads(line) for line in open(args.prompts) if line.strip()][: args.num_prompts]
    qs = [q for q in qs if len(q.get("turns", [])) >= 2]
    if not qs:
        raise SystemExit(f"no question with two turns in {args.prompts}")
    llm = LLM(args.model, device=args.device, draft=None if args.draft == "none" else args.draft,
              speculation=args.speculation, max_num_seqs=args.max_num_seqs, cuda_graphs="auto")
    engine, tok = llm.engine, llm.tokenizer
    t0 = time.perf_counter()
    graphs, prefills = engine.runner.graphs, engine.runner.prefill_graphs
    n_graphs = graphs.capture_all(args.max_num_seqs, modes=("greedy",)) if graphs is not None else 0
    _sync()
    t1 = time.perf_counter()
    mem = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
    n_prefill = (prefills.capture_all(args.max_num_seqs, min(engine.config.max_num_batched_tokens,
                                                             engine.max_model_len))
                 if prefills is not None else 0)
    _sync()
    capture_s = {"decode": round(t1 - t0, 1), "prefill": round(time.perf_counter() - t1, 1)}
    prefill_mib = ((torch.cuda.memory_reserved() - mem) / 2**20) if torch.cuda.is_available() else 0
    counts = instrument()

    def template(messages):
        return tok.encode(tok.apply_chat_template(messages), add_bos=False)

    # a warm-up wave (not timed; the same questions run again below): compiles what capture_all did not touch
    wave_ttft(engine, [template([{"role": "user", "content": qs[0]["turns"][0]}])], 4)
    counts.clear()
    ttft = {1: [], 2: []}
    phase_counts = {}
    for turn in (1, 2):
        before = Counter(counts)
        for w in range(0, len(qs), args.batch):
            wave = qs[w: w + args.batch]
            if turn == 1:
                prompts = [template([{"role": "user", "content": q["turns"][0]}]) for q in wave]
            else:
                prompts = [template([{"role": "user", "content": q["turns"][0]},
                                     {"role": "assistant", "content": q["answer"]},
                                     {"role": "user", "content": q["turns"][1]}]) for q in wave]
            ms, seqs = wave_ttft(engine, prompts, args.max_tokens)
            ttft[turn].append(ms)
            if turn == 1:
                for q, s in zip(wave, seqs):
                    q["answer"] = tok.decode(s.output_ids)
        phase_counts[turn] = {k: v - before.get(k, 0) for k, v in counts.items()
                              if not k.startswith("key") and v - before.get(k, 0)}
    keys = sorted(k for k in counts if k.startswith("key"))
    row = {"model": args.model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "speculation": getattr(engine.tree, "name", None), "batch": args.batch, "questions": len(qs),
           "max_tokens": args.max_tokens, "graphs_ahead": {"decode": n_graphs, "prefill": n_prefill},
           "capture_s": capture_s, "prefill_capture_mib": round(prefill_mib), "max_graphs": pg.MAX_GRAPHS,
           "ttft_ms_turn1": summary(ttft[1]), "ttft_ms_turn2": summary(ttft[2]),
           "prefill_runs_turn1": phase_counts[1], "prefill_runs_turn2": phase_counts[2],
           "distinct_keys": len(keys), "prefill_graphs_held": len(prefills.graphs) if prefills else 0}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(row, keys={k[4:]: counts[k] for k in keys}), f, indent=1)


if __name__ == "__main__":
    main()
