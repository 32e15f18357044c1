"""Where a decode step's wall time goes besides the GPU (issue #5 point 2a): the real engine on the device, SmolLM2
with its draft, graphs on, batch 1.

For each mode it times (a) whole `engine.step()` calls, (b) the step split by timers into packing + the input copy
(`decode_inputs`), the graph launch, the wait + read-back (`collect`) and the rest, (c) bare replays of the step's
captured graph with the same one read-back and nothing else, then with the input copy too, and (d) a cProfile of
the steps (by cumulative and own time). (a) - (c) is the host's share of a step: what the GPU waits for between
graphs. Session 17's runs: docs/benchmarks.md, "Session 17".
  PYTHONPATH=. python3 tools/diag/host_profile.py --prompts question.jsonl [--modes plain,tree:smollm2_48d5]"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from eyas.bench.latency import GREEDY, build_engine, load_models, make_prompts


def timed_steps(engine, prompts, n_prompts, max_tokens, prof=None):
    steps, t = 0, 0.0
    for i, p in enumerate(prompts[:n_prompts]):
        engine.add_request(p, GREEDY.params(i, max_tokens))
        while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
            engine.step()  # prefill, untimed
        torch.cuda.synchronize()
        while engine.has_unfinished():
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            engine.step()
            if prof:
                prof.disable()
            t += time.perf_counter() - t0
            steps += 1
    return t / steps * 1e3, steps


@torch.inference_mode()
def bare_replays(engine, n=300, send=False):
    """The graph of the last batch-1 step, replayed n times with its one read-back: no scheduling, no packing
    (`send`: with the step's host->device copy of its packed inputs before each replay)."""
    graph, _, out = next(iter(engine.runner.graphs.graphs.values()))  # (graph, static inputs, outputs)
    pk = engine.runner.packer(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        if send:
            pk.send()
        graph.replay()
        out.packed[:1].tolist()
    return (time.perf_counter() - t0) / n * 1e3


def split_times(engine, prompts, n_prompts, max_tokens):
    """ms a step in each part, by wrapping them with timers (no profiler): packing + the copy (decode_inputs), the
    graph launch (replay), the wait and read-back (the runner's collect), and the rest of engine.step()."""
    r, g = engine.runner, engine.runner.graphs
    acc = {"inputs": 0.0, "launch": 0.0, "wait+apply": 0.0}

    def timed(name, fn):
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t0
        return w
    orig = (r.decode_inputs, r.collect)
    r.decode_inputs, r.collect = timed("inputs", r.decode_inputs), timed("wait+apply", r.collect)
    graphs = {k: (TimedGraph(v[0], acc), v[1], v[2]) for k, v in g.graphs.items()}
    saved, g.graphs = g.graphs, graphs
    ms, steps = timed_steps(engine, prompts, n_prompts, max_tokens)
    r.decode_inputs, r.collect = orig
    g.graphs = saved
    parts = {k: round(v / steps * 1e3, 4) for k, v in acc.items()}
    parts["rest"] = round(ms - sum(parts.values()), 4)
    return ms, parts


class TimedGraph:
    """A captured graph whose replays add their host time (the launch) to acc["launch"]."""

    def __init__(self, graph, acc):
        self.graph, self.acc = graph, acc

    def replay(self):
        t0 = time.perf_counter()
        self.graph.replay()
        self.acc["launch"] += time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--modes", default="plain,tree:smollm2_48d5")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    dev = torch.device("cuda")
    target, tok, draft, _ = load_models("smollm2", "default", dev, torch.bfloat16, 0, 1, False)
    prompts = make_prompts(tok, target.config.vocab_size, args.num_prompts, 1024, args.prompts)
    for mode in args.modes.split(","):
        engine = build_engine(target, tok, draft, mode, 1, prompts, args.max_tokens, None, True)
        ms, steps = timed_steps(engine, prompts, args.num_prompts, args.max_tokens)
        ms2, parts = split_times(engine, prompts, args.num_prompts, args.max_tokens)
        print(f"=== {mode}: split timing {ms2:.3f} ms a step: {parts}", flush=True)
        bare, bare_send = bare_replays(engine), bare_replays(engine, send=True)
        print(f"=== {mode}: {ms:.3f} ms a step over {steps} steps; bare graph replay + read-back {bare:.3f} ms, "
              f"with the input copy {bare_send:.3f} ms", flush=True)
        prof = cProfile.Profile()
        timed_steps(engine, prompts, args.num_prompts, args.max_tokens, prof)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
