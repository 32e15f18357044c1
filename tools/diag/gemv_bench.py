"""cuBLAS (F.linear) vs the Triton GEMV (eyas/kernels/gemv.py) at the Llama-3.1-8B decode shapes, bf16, M = 1..16.

    PYTHONPATH=. python3 tools/diag/gemv_bench.py --out /tmp/gemv.json      # from the repo root, on a GPU (H200)

For each projection (N, K) and M it times F.linear, gemv_triton with default_config, and a small sweep of configs
(elementwise and tensor-core paths, tiles, split-K, warps, stages), after checking every config against F.linear
(max abs diff). Weights: enough distinct copies per shape (>= 8 and > 400 MB; lm_head 4 copies, 4 GB) that the
50 MB L2 holds none of them, cycled through as the 32 layers of a real forward do. One cycle over the copies is
captured in a CUDA graph (no launch overhead) and replayed; CUDA events over >= 64 calls after warm-up.
Prints a table (µs and TB/s of weight bytes), the per-forward totals at M = 1 and 4 (32 x (qkv + o + gate_up +
down) + lm_head) and "suggested default_config table" lines. The sweep of each (shape, M) stops at its share of
--budget-s (compilation included; the first shapes pay most of it); configs that fail to compile or give wrong results are reported and skipped.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F
import triton

from eyas.kernels.gemv import GemvConfig, default_config, gemv_triton

SHAPES = {  # name: (N, K), Llama-3.1-8B with fused qkv and gate_up
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")
NUM_LAYERS = 32


def n_copies(nbytes: int) -> int:
    """Distinct copies of a weight of `nbytes` bf16 bytes that L2 cannot hold together: 4 above 400 MB (the 8B LM
    head, 1.05 GB), else >= 8 and > 420 MB in all."""
    if nbytes > 400e6:
        return 4
    return max(8, math.ceil(420e6 / nbytes))


def weight_copies(N: int, K: int, dev, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """`n_copies` random weights [N, K] (std 0.02, seed 0) for `time_cycle` to cycle through."""
    torch.manual_seed(0)
    return [torch.randn(N, K, device=dev, dtype=dtype) * 0.02 for _ in range(n_copies(N * K * 2))]


def time_cycle(fn, copies: int, min_calls: int = 64, graph: bool = True) -> float:
    """Mean µs of fn(i) over the weight copies i = 0..copies-1, in a CUDA graph of one cycle when possible."""
    reps = max(4, math.ceil(min_calls / copies))

    def cycle():
        for i in range(copies):
            fn(i)

    g = None
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                cycle()  # warm-up (and any lazy allocation) outside the capture
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                cycle()
        except Exception as e:  # fall back to eager launches
            print(f"    (graph capture failed: {type(e).__name__}: {str(e)[:100]}; timing eager)")
            g = None
            torch.cuda.synchronize()
    run = g.replay if g is not None else cycle
    for _ in range(2):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * copies)


def sweep_configs(M: int, N: int, K: int) -> list[GemvConfig]:
    """The sweep grid for one shape: tiles x split-K around the heuristic's fill of 132 SMs."""
    tiles = []
    if M <= 4:  # elementwise path: the float32 accumulator holds M_PAD x BLOCK_N x BLOCK_K values
        m_pad = triton.next_power_of_2(M)
        for block_k in (128, 256, 512):
            for elems, warps in ((4096, 4), (8192, 8)):
                block_n = max(1, elems // (block_k * m_pad))
                tiles.append(dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=4, use_dot=False))
    for block_n, block_k, warps, stages in ((64, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3), (128, 64, 4, 4),
                                            (128, 128, 8, 3), (32, 256, 4, 4), (64, 64, 4, 6), (128, 64, 4, 6)):
        tiles.append(dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, use_dot=True))
    out = []
    for t in tiles:
        n_tiles = triton.cdiv(N, t["BLOCK_N"])
        s = 1
        while n_tiles * s < 3 * 132 and s < 16 and triton.cdiv(K, 2 * s) >= 4 * t["BLOCK_K"]:
            s *= 2
        for split in sorted({s, max(1, s // 2), min(32, 2 * s)}):
            if triton.cdiv(K, split) >= t["BLOCK_K"]:
                out.append(GemvConfig(SPLIT_K=split, **t))
    return out


def cfg_str(c: GemvConfig) -> str:
    path = "dot" if c.use_dot else "ew"
    return f"{path} N{c.BLOCK_N} K{c.BLOCK_K} S{c.SPLIT_K} w{c.num_warps} s{c.num_stages}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write all results as JSON here")
    ap.add_argument("--ms", default="1,2,4,8,16", help="comma-separated M values")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=110.0, help="stop sweeping (defaults still timed) after this")
    ap.add_argument("--no-sweep", action="store_true", help="time cuBLAS and the default config only")
    ap.add_argument("--no-graph", action="store_true", help="time eager launches instead of a CUDA graph")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    ms = [int(m) for m in args.ms.split(",")]
    shapes = [s for s in args.shapes.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    t_start = time.time()
    results = []  # one record per (shape, M)
    n_records = len(shapes) * len(ms)  # the sweep budget is shared out evenly, in order
    graph = not args.no_graph

    for name in shapes:
        N, K = SHAPES[name]
        wbytes = N * K * 2
        ws = weight_copies(N, K, dev, dtype)
        C = len(ws)
        print(f"\n{name} N={N} K={K}: {C} copies x {wbytes / 1e6:.0f} MB = {C * wbytes / 1e9:.2f} GB")
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=dtype)
            ref = F.linear(x, ws[0])
            tol = 2 ** -6 * ref.abs().max().item() + 1e-3  # a few bf16 steps of the largest output
            rec = dict(shape=name, N=N, K=K, M=M, weight_bytes=wbytes, copies=C)

            us = time_cycle(lambda i: F.linear(x, ws[i]), C, graph=graph)
            rec["cublas_us"] = us

            def try_cfg(cfg):
                try:
                    out = gemv_triton(x, ws[0], config=cfg)
                    torch.cuda.synchronize()
                    err = (out.float() - ref.float()).abs().max().item()
                    if not err <= tol:
                        return None, err, f"wrong result (max abs diff {err:.3g} > {tol:.3g})"
                    return time_cycle(lambda i: gemv_triton(x, ws[i], config=cfg), C, graph=graph), err, None
                except Exception as e:  # out of resources, compile errors: move on
                    torch.cuda.synchronize()
                    return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"

            dcfg = default_config(M, N, K, dtype)
            dus, derr, dmsg = try_cfg(dcfg)
            rec.update(default_config=asdict(dcfg), default_us=dus, default_maxdiff=derr, default_error=dmsg)
            best = (dus, dcfg) if dus is not None else (None, None)
            tried = []
            if not args.no_sweep:
                deadline = t_start + args.budget_s * (len(results) + 1) / n_records
                for cfg in sweep_configs(M, N, K):
                    if time.time() > deadline:
                        rec["sweep_truncated"] = True
                        break
                    if cfg == dcfg:
                        continue
                    cus, cerr, cmsg = try_cfg(cfg)
                    tried.append(dict(config=asdict(cfg), us=cus, maxdiff=cerr, error=cmsg))
                    if cmsg:
                        print(f"    skip {cfg_str(cfg)}: {cmsg}")
                    if cus is not None and (best[0] is None or cus < best[0]):
                        best = (cus, cfg)
            rec["sweep"] = tried
            rec["best_us"], rec["best_config"] = best[0], asdict(best[1]) if best[1] is not None else None
            results.append(rec)

            def bw(t):
                return f"{t:8.1f} {wbytes / t / 1e6:5.2f}" if t is not None else f"{'fail':>8} {'':5}"
            print(f"  M={M:2d}  cuBLAS {bw(us)}  | default {bw(dus)} ({cfg_str(dcfg)})"
                  f"  | best {bw(best[0])} ({cfg_str(best[1]) if best[1] else '-'})  [{len(tried)} swept,"
                  f" {time.time() - t_start:.0f} s]")
        del ws
        torch.cuda.empty_cache()

    # ---- summary
    print("\nshape      M | cuBLAS us  TB/s | default us  TB/s | best us  TB/s | best config")
    for r in results:
        def f(t):
            return f"{t:9.1f} {r['weight_bytes'] / t / 1e6:5.2f}" if t is not None else f"{'fail':>9} {'':5}"
        bc = cfg_str(GemvConfig(**r["best_config"])) if r["best_config"] else "-"
        print(f"{r['shape']:8s} {r['M']:3d} | {f(r['cublas_us'])} | {f(r['default_us'])} | {f(r['best_us'])} | {bc}")

    by = {(r["shape"], r["M"]): r for r in results}
    totals = {}
    for M in (1, 4):
        if not all((s, M) in by for s in SHAPES):
            continue
        t = {}
        for key in ("cublas_us", "default_us", "best_us"):
            vals = [by[(s, M)][key] for s in SHAPES]
            if any(v is None for v in vals):
                t[key] = None
                continue
            t[key] = NUM_LAYERS * sum(by[(s, M)][key] for s in LAYER_SHAPES) + by[("lm_head", M)][key]
        nbytes = NUM_LAYERS * sum(SHAPES[s][0] * SHAPES[s][1] * 2 for s in LAYER_SHAPES) + 128256 * 4096 * 2
        totals[M] = dict(t, weight_bytes=nbytes)
        txt = "  ".join(f"{k[:-3]} {v / 1e3:.3f} ms ({nbytes / v / 1e6:.2f} TB/s)" if v else f"{k[:-3]} n/a"
                        for k, v in t.items())
        print(f"8B forward, M={M}: {txt}")

    print("\nsuggested default_config table (shape, M -> best config; default and cuBLAS for reference):")
    for r in results:
        if r["best_config"]:
            print(f"  ({r['M']}, {r['N']}, {r['K']}): GemvConfig(**{r['best_config']}),  # {r['shape']}: "
                  f"best {r['best_us']:.1f} us, default {r['default_us'] or float('nan'):.1f}, "
                  f"cuBLAS {r['cublas_us']:.1f}")
    print(f"total {time.time() - t_start:.0f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, results=results,
                           totals={str(k): v for k, v in totals.items()}), fh, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
