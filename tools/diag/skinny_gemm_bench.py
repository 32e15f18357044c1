"""Is the tile kernel's per-element pointer arithmetic what keeps it behind cuBLAS at 4-64 rows? (GPU only.)

    PYTHONPATH=. python3 tools/diag/skinny_gemm_bench.py --out /tmp/skinny.json

y = x W^T for a few rows x [M, K] against the weight shapes of a verify pass (the 8B shape at 4 rows: `chain:3`;
SmolLM2's at 49: its default tree), 32 distinct weights per kind so that L2 holds none between launches, one CUDA
graph, us per launch. Variants, all plain (no prologue or epilogue), the weight streamed through `tl.dot` as in
`eyas.kernels.decode_linear._tile_linear_kernel` (acc[rows, M_PAD] += w @ x^T):

* `cublas`: F.linear (its split-K reduction included where it takes one);
* `tile`: decode_linear's tile kernel (pointer tensors for every element of x and of the weight tile);
* `bptr`: the same loop on block pointers (`tl.make_block_ptr` / `tl.advance`; Triton 3.6 has them, 3.9 has
  removed them: the variant then records its error);
* `tma`: the same loop on host-built tensor descriptors (Hopper's bulk tensor copies, `TensorDescriptor`).

Configs BLOCK_NxBLOCK_KxWARPSxSTAGES (`--configs`). Session 18's run: docs/benchmarks.md, "Session 18" (the
descriptor loop matches cuBLAS; the branch exp/s18-tma-tiles built the verify layers on it, with epilogues, and
lost in the engine).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from eyas.kernels.decode_linear import decode_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_chain_bench import time_fn  # noqa: E402
from tile_chain_bench import parse_cfg  # noqa: E402

KINDS = {"8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gu": (28672, 4096), "down": (4096, 14336)},
         "smollm2": {"qkv": (960, 576), "o": (576, 576), "gu": (3072, 576), "down": (576, 1536)}}


@triton.jit
def _bptr_kernel(X, W, OUT, M, N, K, stride_x, stride_o, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 M_PAD: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    wp = tl.make_block_ptr(W, (N, K), (K, 1), (n0, 0), (BLOCK_N, BLOCK_K), (1, 0))
    xp = tl.make_block_ptr(X, (M, K), (stride_x, 1), (0, 0), (M_PAD, BLOCK_K), (1, 0))
    acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    for _ in range(0, K, BLOCK_K):
        w = tl.load(wp, boundary_check=(0, 1), padding_option="zero")
        x = tl.load(xp, boundary_check=(0, 1), padding_option="zero")
        acc = tl.dot(w, tl.trans(x), acc)
        wp = tl.advance(wp, (0, BLOCK_K))
        xp = tl.advance(xp, (0, BLOCK_K))
    n = n0 + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    tl.store(OUT + m[None, :] * stride_o + n[:, None], acc.to(OUT.dtype.element_ty),
             mask=(m[None, :] < M) & (n[:, None] < N))


@triton.jit
def _tma_kernel(x_desc, w_desc, OUT, M, N, K, stride_o, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                M_PAD: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = w_desc.load([n0, k0])
        x = x_desc.load([0, k0])
        acc = tl.dot(w, tl.trans(x), acc)
    n = n0 + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    tl.store(OUT + m[None, :] * stride_o + n[:, None], acc.to(OUT.dtype.element_ty),
             mask=(m[None, :] < M) & (n[:, None] < N))


def launch(variant, x, w, out, cfg, descs=None):
    M, K = x.shape
    N = w.shape[0]
    m_pad = max(16, triton.next_power_of_2(M))
    grid = (triton.cdiv(N, cfg.BLOCK_N),)
    if variant == "bptr":
        _bptr_kernel[grid](x, w, out, M, N, K, x.stride(0), out.stride(0), BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                           M_PAD=m_pad, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    elif variant == "tma":
        xd, wd = descs
        _tma_kernel[grid](xd, wd, out, M, N, K, out.stride(0), BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                          M_PAD=m_pad, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        decode_linear(x, w, out=out, config=cfg)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="8b:4,smollm2:49,smollm2:4")
    ap.add_argument("--configs", default="32x128x4x4,64x128x4x4,128x128x4x4,64x256x4x3,128x64x4x6,64x64x4x6")
    ap.add_argument("--variants", default="tile,bptr,tma")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from triton.tools.tensor_descriptor import TensorDescriptor
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for case in args.cases.split(","):
        shape, M = case.split(":")
        M = int(M)
        for kind, (N, K) in KINDS[shape].items():
            ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(args.layers)]
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            row = {"shape": shape, "M": M, "kind": kind, "N": N, "K": K}
            row["cublas_us"] = time_fn(lambda: [F.linear(x, w) for w in ws], args.reps) * 1e3 / len(ws)
            best = {}
            for c in args.configs.split(","):
                cfg = parse_cfg(c)
                for v in args.variants.split(","):
                    try:
                        descs = [None] * len(ws)  # the descriptor variant's (x, weight) descriptors per weight
                        if v == "tma":
                            xd = TensorDescriptor.from_tensor(x, [max(16, triton.next_power_of_2(M)), cfg.BLOCK_K])
                            descs = [(xd, TensorDescriptor.from_tensor(w, [cfg.BLOCK_N, cfg.BLOCK_K])) for w in ws]
                        launch(v, x, ws[0], out, cfg, descs[0])
                        err = (out.float() - ref.float()).abs().max().item()
                        us = time_fn(lambda: [launch(v, x, w, out, cfg, d) for w, d in zip(ws, descs)],
                                     args.reps) * 1e3 / len(ws)
                        row[f"{v}_{c}_us"] = round(us, 2)
                        row[f"{v}_{c}_err"] = err
                        if us < best.get(v, (1e9, ""))[0]:
                            best[v] = (us, c)
                    except Exception as e:  # noqa: BLE001 - record and go on
                        row[f"{v}_{c}_error"] = f"{type(e).__name__}: {e}"[:300]
            row["best"] = {v: [round(u, 2), c] for v, (u, c) in best.items()}
            res["rows"].append(row)
            print(shape, M, kind, "cublas", round(row["cublas_us"], 2), "best", row["best"],
                  "errors", {k: v for k, v in row.items() if k.endswith("_error")} or "", flush=True)
            del ws
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
