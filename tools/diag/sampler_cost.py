"""The sampler's distribution with and without the vocabulary sort (`eyas.layers.sampler.logits_to_probs`):
`filters=True` (the general path: temperature, min-p, top-k, top-p; a sort of every row) against `filters=False`
(the softmax alone, what a step takes when no sampled request asks for a filter). Rows are a step's tree nodes
(batch x (tree nodes + 1)); random logits of SmolLM2's 49,152-token vocabulary, temperature 0.8, filters off.
On CUDA also the filters' thresholds found without a sort (`eyas.kernels.filter_threshold`) at top-p 0.9 and top-k
50 by radix selection, what a filtered step takes (`eyas.spec.step.SORT_FREE_FILTERS`); `--graph` times them as a
graph's replay.

    python tools/diag/sampler_cost.py [--rows 1 49 192 1568] [--repeat 20] [--device cpu|cuda] [--threads N]
        [--graph]
"""
from __future__ import annotations

import argparse
import time

import torch

from eyas.layers.sampler import logits_to_probs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 49, 192, 1568])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")
    ap.add_argument("--graph", action="store_true", help="on CUDA: time the thresholds as a CUDA graph's replay")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"| rows | with the sort (filters=True), ms | softmax alone (filters=False), ms | ratio |  ({dev}, "
          f"{torch.get_num_threads()} threads)")
    print("| --- | --- | --- | --- |")
    for n in args.rows:
        g = torch.Generator(device=dev).manual_seed(n)
        logits = torch.randn(n, args.vocab, device=dev, generator=g) * 3
        t, k = torch.full((n,), 0.8, device=dev), torch.full((n,), -1, device=dev)
        p, m = torch.ones(n, device=dev), torch.zeros(n, device=dev)
        ms = []
        for filters in (True, False):
            logits_to_probs(logits, t, k, p, m, filters)  # warm-up
            sync()
            t0 = time.perf_counter()
            for _ in range(args.repeat):
                logits_to_probs(logits, t, k, p, m, filters)
            sync()
            ms.append((time.perf_counter() - t0) / args.repeat * 1e3)
        line = f"| {n} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[0] / ms[1]:.1f}x |"
        if dev.type == "cuda":  # the thresholds by bisection, top-p 0.9 and top-k 50
            from eyas.kernels.filter_threshold import filter_threshold_triton
            bf = logits.bfloat16()
            args_ft = (bf, t, torch.full((n,), 50, device=dev), torch.full((n,), 0.9, device=dev), m)
            run = (lambda: filter_threshold_triton(*args_ft))
            run()
            sync()
            if args.graph:  # the launches as one graph's replay, as a captured step runs them
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                run = graph.replay
            t0 = time.perf_counter()
            for _ in range(args.repeat):
                run()
            sync()
            line += f" radix selection (top-p 0.9, top-k 50): {(time.perf_counter() - t0) / args.repeat * 1e3:.3f} ms |"
        print(line)


if __name__ == "__main__":
    main()
