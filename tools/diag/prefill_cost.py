"""Where the time to the first token goes (TTFT at batch 1): one request's prefill on the real engine, graphs on.

For each prompt length it times (a) the engine's TTFT as `eyas bench latency` does (add the request, step until its
first token is known), (b) `ModelRunner.prefill` alone, (c) its phases with a device synchronisation around each
(the target's forward, eager or replayed from its graph, the logits and the first token (both in the graph since
session 62, and then in the forward's time), the draft's catch-up, the rest), and (d) one prefill under the torch
profiler: how many kernels it launches and how long the GPU is busy. (b) - (d)'s GPU time is what the host
costs. Random prompts; `--model smollm2-shape` needs no weights (its draft is random too: acceptance does not matter
for a prefill). Session 61's rows: docs/benchmarks.md, "Session 61".
  PYTHONPATH=. python3 tools/diag/prefill_cost.py [--model smollm2] [--lengths 16,64,128,512,1024] [--mode plain]"""
from __future__ import annotations

import argparse
import json
import time

import torch

from eyas.bench.latency import GREEDY, build_engine, load_models


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ttft(engine, prompt, i):
    sync()
    t0 = time.perf_counter()
    s = engine.add_request(prompt, GREEDY.params(i, 2))
    while s.num_output == 0:
        engine.step()
    sync()
    t = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return t * 1e3


def run_request(engine, prompt, i, hook):
    """Run one request to its end, its prefill through hook(runner.prefill) (the runner's own method after it)."""
    r = engine.runner
    orig = r.prefill
    r.prefill = hook(orig)
    try:
        s = engine.add_request(prompt, GREEDY.params(i, 2))
        while s.num_output == 0:
            engine.step()
        r.prefill = orig
        while engine.has_unfinished():
            engine.step()
    finally:
        r.prefill = orig


def timer(acc: dict, inside: list | None = None):
    """A hook for `run_request`: times the prefill into acc["ms"] (synchronised), marking `inside` meanwhile."""
    def hook(orig):
        def timed(seqs, lens):
            sync()
            if inside is not None:
                inside.append(1)
            t0 = time.perf_counter()
            out = orig(seqs, lens)
            sync()
            acc["ms"] = (time.perf_counter() - t0) * 1e3
            if inside is not None:
                inside.clear()
            return out
        return timed
    return hook


def prefill_only(engine, prompt, i):
    """ms of `runner.prefill` for the request, the scheduler's admission outside the timer."""
    acc = {}
    run_request(engine, prompt, i, timer(acc))
    return acc["ms"]


PHASES = ("forward", "logits", "first_token", "draft_prefill")


def phases(engine, prompt, i):
    """ms of each phase of one prefill, a synchronisation on either side of each (so they do not overlap)."""
    r = engine.runner
    acc = dict.fromkeys(PHASES, 0.0)
    saved, total, inside = [], {}, []

    def wrap(obj, name, key):
        fn = getattr(obj, name)
        saved.append((obj, name))

        def w(*a, **k):
            if not inside:  # a decode step's eager forward (the CPU), not the prefill's
                return fn(*a, **k)
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            acc[key] += (time.perf_counter() - t0) * 1e3
            return out
        setattr(obj, name, w)
    wrap(r.target, "forward", "forward")
    if r.prefill_graphs is not None:  # a graphed prefill's forward is a replay
        wrap(r.prefill_graphs, "run", "forward")
    wrap(r.target, "compute_logits", "logits")
    wrap(r, "_first_tokens", "first_token")
    if r.draft is not None:
        wrap(r, "_draft_prefill", "draft_prefill")
    try:
        run_request(engine, prompt, i, timer(total, inside))
    finally:
        for obj, name in saved:  # the wrappers are instance attributes over the class's methods
            delattr(obj, name)
    acc = {k: round(v, 3) for k, v in acc.items()}
    acc["rest"] = round(total["ms"] - sum(acc.values()), 3)
    return acc


def profiled(engine, prompt, i):
    """(kernels launched, GPU busy ms, the busiest kernels) of one prefill."""
    from torch.profiler import ProfilerActivity, profile
    box = {}

    def hook(orig):
        def prof(seqs, lens):
            sync()
            act = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
            with profile(activities=[act]) as p:
                out = orig(seqs, lens)
                sync()
            box["p"] = p
            return out
        return prof
    run_request(engine, prompt, i, hook)
    ev = [e for e in box["p"].events() if e.device_type.name == "CUDA"]
    busy_us = sum(e.device_time for e in ev)
    top = {}
    for e in ev:
        top[e.name] = top.get(e.name, 0) + e.device_time
    top = sorted(top.items(), key=lambda kv: -kv[1])[:8]
    return len(ev), round(busy_us / 1e3, 3), [(n[:60], round(t, 1)) for n, t in top]


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-shape")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--mode", default="tree:smollm2_48d5")
    ap.add_argument("--lengths", default="16,64,128,512,1024")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device(args.device)
    target, tok, draft, _ = load_models(args.model, args.draft if args.mode != "plain" else None, dev,
                                        torch.bfloat16, 0, 1, False)
    lengths = [int(x) for x in args.lengths.split(",")]
    g = torch.Generator().manual_seed(0)
    prompts = {n: [torch.randint(10, target.config.vocab_size, (n,), generator=g).tolist()
                   for _ in range(args.repeat + 1)] for n in lengths}
    engine = build_engine(target, tok, draft, args.mode, 1, [p for n in lengths for p in prompts[n]], 2, None,
                          dev.type == "cuda")
    rows = []
    for n in lengths:
        ps = prompts[n]
        ttft(engine, ps[-1], 0)  # warm: this length's kernels compiled
        t = median([ttft(engine, p, j) for j, p in enumerate(ps[:-1])])
        pf = median([prefill_only(engine, p, j) for j, p in enumerate(ps[:-1])])
        ph = [phases(engine, p, j) for j, p in enumerate(ps[:-1])]
        ph = {k: median([x[k] for x in ph]) for k in ph[0]}
        kernels, busy, top = profiled(engine, ps[0], 0)
        row = {"mode": args.mode, "prompt_tokens": n, "ttft_ms": round(t, 3), "prefill_ms": round(pf, 3),
               "phases_ms": ph, "kernels": kernels, "gpu_busy_ms": busy, "top_kernels_us": top}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
