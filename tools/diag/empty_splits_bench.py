"""The split attention's empty splits at SmolLM2's shapes (9 query / 3 kv heads, D = 64, bf16): us per layer call of
the default tree's verify attention (49 new tokens, `split_tree_attention_triton`) and of plain decoding's
(`paged_prefix_attention`, one token), over contexts and block-table widths: every split stores its o and lse and
the reduction reads them all (`all`), or splits without keys store nothing and the reduction reads only the splits
the context gives keys (`skip`), with the tree's suffix programs first in the grid (`skip_sf`); `rule` is the
module's defaults (skip and suffix first where the partials exceed SKIP_EMPTY_BYTES).
`--bounds` adds rows whose split count comes from min(width, bound) tokens instead of the width (a context bucket
of that many tokens, `eyas.engine.cuda_graph.CONTEXT_BUCKETS`).
Ways the code no longer has: session 33's skip (splits without keys storing their lse, the reduction's o loads
waiting for it: 8.33 us a tree layer at 150 keys in a table 8256 tokens wide, against 6.57 for `skip_sf`, session
34's call 7), the same with the exit before the query load (6.90-6.93), and splits without keys storing no o with
the reduction loading every o at once (session 33's call 5: it read o that was not just written and lost to `all`).

A CUDA graph fixes the split count by the block table's width (max_model_len), as the engine's graphs do, so a short
context in a wide table leaves most splits without keys. 30 layers of separate caches are captured in one graph,
launches with PDL as the engine's fused path makes them.
  PYTHONPATH=. python3 tools/diag/empty_splits_bench.py [--out FILE.json]"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import eyas.kernels.tree_attention as ta

sys.path.insert(0, str(Path(__file__).resolve().parent))
from l2_prefetch_bench import capture_graph, time_graph  # noqa: E402

H, KVH, D, LAYERS, PAGE = 9, 3, 64, 30, 16


# each variant's settings of eyas.kernels.tree_attention; "rule" (added in main) is the module's defaults
VARIANTS = {
    "all": dict(SKIP_EMPTY_SPLITS=False),
    "skip": dict(SKIP_EMPTY_SPLITS=True, SKIP_EMPTY_BYTES=0, SUFFIX_FIRST=False),
    "skip_sf": dict(SKIP_EMPTY_SPLITS=True, SKIP_EMPTY_BYTES=0, SUFFIX_FIRST=True),
}
DEFAULTS = {k: getattr(ta, k) for k in ("SKIP_EMPTY_SPLITS", "SKIP_EMPTY_BYTES", "SUFFIX_FIRST")}


def bench(mode: str, ctx: int, width_tokens: int, variant: str, reps: int = 50,
          bound: int | None = None) -> tuple[float, int]:
    """(us per layer call, splits) for `mode` ("tree": 49 tokens, "plain": 1) at `ctx` cached tokens in block
    tables `width_tokens` wide; `bound`: the split count from min(width, bound) tokens instead of the width."""
    for k, v in {**DEFAULTS, **VARIANTS[variant]}.items():
        setattr(ta, k, v)
    dev = torch.device("cuda")
    blocks = -(-width_tokens // PAGE)
    caches = [(torch.randn(blocks, PAGE, KVH, D, device=dev, dtype=torch.bfloat16),
               torch.randn(blocks, PAGE, KVH, D, device=dev, dtype=torch.bfloat16)) for _ in range(LAYERS)]
    bt = torch.arange(blocks, device=dev, dtype=torch.int32).view(1, blocks)
    cl = torch.full((1,), ctx, device=dev, dtype=torch.int32)
    nq = 49 if mode == "tree" else 1
    q = torch.randn(1, nq, H, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(1, nq, KVH, D, device=dev, dtype=torch.bfloat16)
    vn = torch.randn(1, nq, KVH, D, device=dev, dtype=torch.bfloat16)
    mask = torch.tril(torch.ones(1, nq, nq, device=dev, dtype=torch.bool))
    m_tiles = -(-nq * H // KVH // ta._tiles(nq * H // KVH, D, torch.bfloat16)[0])
    split_tokens = blocks * PAGE if bound is None else min(blocks * PAGE, bound)
    splits = ta.choose_num_splits(KVH * m_tiles, split_tokens, ta.device_sm_count(dev))

    def run():
        for k, v in caches:
            if mode == "tree":
                ta.split_tree_attention_triton(q, kn, vn, k, v, bt, cl, mask, D ** -0.5, num_splits=splits,
                                               out_dtype=torch.bfloat16, pdl=True)
            else:
                ta.paged_prefix_attention(q, k, v, bt, cl, D ** -0.5, num_splits=splits, max_context_len=split_tokens,
                                          out_dtype=torch.bfloat16, pdl=True)

    g = capture_graph(run)
    us = time_graph(g, reps) * 1000 / LAYERS
    del g, caches
    torch.cuda.empty_cache()
    return us, splits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="150,400,1500")
    ap.add_argument("--widths", default="512,2112,8256", help="block-table widths in tokens (max_model_len + ~64)")
    ap.add_argument("--rounds", type=int, default=2, help="the variants alternated this many times")
    ap.add_argument("--variants", default="all,skip_sf", help=f"of {', '.join(VARIANTS)} and rule (the default)")
    ap.add_argument("--bounds", default="", help="split counts from min(width, B) tokens too, for each B: "
                                                  "rows VARIANT/bB")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    VARIANTS["rule"] = {}
    keys = [(v, None) for v in args.variants.split(",")]
    keys += [(v, int(b)) for b in args.bounds.split(",") if b for v in args.variants.split(",")]
    rows = []
    for mode in ("tree", "plain"):
        for width in map(int, args.widths.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                if ctx > width:
                    continue
                runs, splits = {k: [] for k in keys}, {}
                for _ in range(args.rounds):
                    for v, b in keys:
                        us, splits[(v, b)] = bench(mode, ctx, width, v, bound=b)
                        runs[(v, b)].append(us)
                name = {k: k[0] if k[1] is None else f"{k[0]}/b{k[1]}" for k in keys}
                print(f"{mode:5s} width {width:5d} ctx {ctx:5d} | " + ", ".join(
                    f"{name[k]} ({splits[k]}) {min(r):6.2f}" for k, r in runs.items()) + " us a layer", flush=True)
                rows.append({"mode": mode, "width_tokens": width, "ctx": ctx,
                             **{f"{name[k]}_us": r for k, r in runs.items()},
                             **{f"{name[k]}_splits": splits[k] for k in keys}})
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
