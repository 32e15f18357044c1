"""Where `eyas make-distill-data`'s wall time goes at a large batch: the real engine, phase by phase.

    PYTHONPATH=. python3 tools/diag/engine_phases.py --data sg.jsonl.xz --time-budget 40 [--batch-size 256]
        [--max-batched-tokens N] [--min-admit N] [--device cuda] [--limit N] [--max-tokens 160]

It wraps, with wall-clock timers, the scheduler's `schedule`, the runner's `prefill` (which reads its sampled tokens
back, so its time includes the GPU's), `launch` (enqueueing a decode step), `collect` split into the wait for the
step's event and the rest, and the engine's `_commit`; then regenerates `--data` as `make-distill-data` does
(first turns, greedy, `--draft default --speculation chain:3`) within `--time-budget` seconds. It prints one JSON
object: seconds in each phase, prefill steps and the sequences in them, decode steps and their mean batch, tokens/s.
`wait` is GPU time the host did not overlap; the rest is the host's. A record of where time goes, not a fast path.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict

from eyas.engine.engine import LLMEngine
from eyas.engine.runner import ModelRunner
from eyas.engine.scheduler import Scheduler

T: dict = defaultdict(float)
N: dict = defaultdict(int)


def timed(cls, name, key, count=None):
    f = getattr(cls, name)

    def wrapper(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return f(self, *a, **k)
        finally:
            T[key] += time.perf_counter() - t0
            N[key] += 1
            if count is not None:
                N[key + "_items"] += count(*a)
    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--time-budget", type=float, default=40)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--max-batched-tokens", type=int, default=None)
    ap.add_argument("--min-admit", type=int, default=1, help="EngineConfig.min_admit")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()

    timed(Scheduler, "schedule", "schedule")
    timed(ModelRunner, "prefill", "prefill", count=lambda seqs, chunks: len(seqs))
    timed(ModelRunner, "launch", "launch", count=lambda seqs, after=None: len(seqs))
    timed(LLMEngine, "_commit", "commit")
    collect = ModelRunner.collect

    def collect_timed(self, h):
        t0 = time.perf_counter()
        if h.done is not None:
            h.done.synchronize()
        t1 = time.perf_counter()
        out = collect(self, h)
        T["wait"] += t1 - t0
        T["collect_rest"] += time.perf_counter() - t1
        N["collect"] += 1
        return out
    ModelRunner.collect = collect_timed
    step = LLMEngine.step

    def step_timed(self):
        t0 = time.perf_counter()
        try:
            return step(self)
        finally:
            T["step"] += time.perf_counter() - t0
            N["step"] += 1
    LLMEngine.step = step_timed

    from eyas.train import distill_data
    kw = {}
    if args.max_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_batched_tokens
    with tempfile.TemporaryDirectory() as d:
        info = distill_data.make_distill_data(args.model, args.data, f"{d}/out.jsonl", max_tokens=args.max_tokens,
                                              batch_size=args.batch_size, limit=args.limit, max_turns=1,
                                              device=args.device, draft="default", speculation="chain:3",
                                              progress=False, time_budget=args.time_budget,
                                              max_prompt_tokens=1024, min_admit=args.min_admit, **kw)
    gen = info["generation_seconds"]
    phases = {k: round(v, 2) for k, v in sorted(T.items())}
    other = T["step"] - sum(T[k] for k in ("schedule", "prefill", "launch", "wait", "collect_rest", "commit"))
    print(json.dumps({"args": vars(args), "generation_seconds": gen,
                      "generated_tokens_per_second": info["generated_tokens_per_second"],
                      "seconds": phases, "step_other": round(other, 2),
                      "outside_steps": round(gen - T["step"], 2), "counts": dict(N),
                      "prefill_mean_seqs": round(N["prefill_items"] / max(N["prefill"], 1), 1),
                      "decode_mean_batch": round(N["launch_items"] / max(N["launch"], 1), 1),
                      "commit_us": round(T["commit"] / max(N["commit"], 1) * 1e6, 2)}, indent=1))


if __name__ == "__main__":
    main()
