"""Paged prefix attention (eyas.kernels.tree_attention.paged_prefix_attention) at Llama-3.1-8B decode shapes: time
per layer call for a sweep of KV splits and key-tile widths, against what `choose_num_splits` picks now.

32 separate caches (one per layer, as a forward sees them) defeat the 50 MB L2; the 32 calls are captured in one CUDA
graph, so launch gaps count as they do in the engine. Prints us per call and the effective KV read bandwidth.
  PYTHONPATH=. python3 tools/diag/prefix_split_bench.py [--out FILE.json]"""
from __future__ import annotations

import argparse
import json

import torch

from eyas.kernels.tree_attention import choose_num_splits, device_sm_count, paged_prefix_attention

H, KVH, D, LAYERS, PAGE = 32, 8, 128, 32, 16


def bench(B, NQ, ctx, splits, block_n, reps=20):
    dev = torch.device("cuda")
    blocks = -(-ctx // PAGE)
    caches = [(torch.randn(B * blocks, PAGE, KVH, D, device=dev, dtype=torch.bfloat16),
               torch.randn(B * blocks, PAGE, KVH, D, device=dev, dtype=torch.bfloat16)) for _ in range(LAYERS)]
    bt = torch.arange(B * blocks, device=dev, dtype=torch.int32).view(B, blocks)
    cl = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(B, NQ, H, D, device=dev, dtype=torch.bfloat16)

    def run():
        for k, v in caches:
            paged_prefix_attention(q, k, v, bt, cl, D ** -0.5, num_splits=splits, max_context_len=ctx,
                                   block_n=block_n)
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            run()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    us = e0.elapsed_time(e1) * 1000 / reps / LAYERS
    gbs = B * ctx * KVH * D * 2 * 2 / (us * 1e-6) / 1e12
    del caches
    torch.cuda.empty_cache()
    return us, gbs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sms = device_sm_count(torch.device("cuda"))
    rows = []
    for B, NQ, ctx in [(1, 1, 1024), (1, 4, 1024), (1, 8, 1024), (4, 4, 1024), (32, 1, 1024), (32, 4, 1024),
                       (1, 1, 4096), (8, 1, 4096)]:
        m_tiles = 1 if NQ * H // KVH <= 64 else 2
        now = choose_num_splits(B * KVH * m_tiles, ctx + 128, sms)
        res = {}
        for splits in sorted({1, 2, 3, 4, 8, 16, 32, now}):
            if ctx // splits < 32:
                continue
            for bn in (32, 64, 128):
                try:
                    res[(splits, bn)] = bench(B, NQ, ctx, splits, bn)
                except Exception:  # e.g. out of shared memory
                    res[(splits, bn)] = (float("inf"), 0.0)
        best = min(res, key=lambda k: res[k][0])
        cur = res.get((now, 64), (float("nan"), 0))
        print(f"B={B:2d} Q={NQ} ctx={ctx:5d} | now: {now:2d} splits, bn 64: {cur[0]:7.2f} us {cur[1]:5.2f} TB/s | "
              f"best: {best[0]:2d} splits, bn {best[1]:3d}: {res[best][0]:7.2f} us {res[best][1]:5.2f} TB/s", flush=True)
        print("   " + "  ".join(f"{s}/{bn}:{v[0]:.1f}" for (s, bn), v in sorted(res.items())), flush=True)
        rows.append({"B": B, "Q": NQ, "ctx": ctx, "now_splits": now, "now_us": cur[0], "best": list(best),
                     "best_us": res[best][0], "all": {f"{s}/{bn}": v[0] for (s, bn), v in res.items()}})
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
