"""Experiment: the register kernel for a few rows with per-thread partial sums (one cross-thread reduction for all
rows), against cuBLAS, on the 8B linears. GPU only.

    PYTHONPATH=. python3 tools/diag/rows_reg_bench.py --rows 1,4 --out /tmp/reg.json

Configs BLOCK_NxWARPSxVEC; the `L` variant sums VEC neighbouring products per thread and reduces across threads
once after the last row, the plain one reduces each row (as `eyas.kernels.decode_linear` does). Session 15 (H200,
docs/bench/few_rows_s15.json, call 2): at one row most configs beat cuBLAS (gate/up 53.5-57.8 us against 56.7);
at four rows every config is slower than cuBLAS on every kind (gate/up 78-127 us against 56, down 52-70 against
32), so the idea was not taken into the library.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_chain_bench import time_fn  # noqa: E402


@triton.jit
def _reg_rows_kernel(X, W, OUT, M, N, K, stride_x, stride_o, KP: tl.constexpr, BLOCK_N: tl.constexpr,
                     M_PAD: tl.constexpr, VEC: tl.constexpr, LATE: tl.constexpr):
    pid = tl.program_id(0)
    offs_k = tl.arange(0, KP)
    k_ok = offs_k < K
    offs_m = tl.arange(0, M_PAD)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.where(n_ok, n, 0).to(tl.int64)
    w = tl.load(W + rows[:, None] * K + offs_k[None, :], mask=k_ok[None, :], other=0.0)
    wf = w.to(tl.float32)
    if LATE:
        acc3 = tl.zeros((BLOCK_N, M_PAD, KP // VEC), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    for m in tl.static_range(M_PAD):
        lim = tl.minimum(K, (M - m) * K)
        x = tl.load(X + m * stride_x + offs_k, mask=offs_k < lim, other=0.0).to(tl.float32)
        p = wf * x[None, :]
        if LATE:
            p = tl.sum(tl.reshape(p, (BLOCK_N, KP // VEC, VEC)), axis=2)
            acc3 = tl.where((offs_m == m)[None, :, None], p[:, None, :], acc3)
        else:
            part = tl.sum(p, axis=1)
            acc = tl.where((offs_m == m)[None, :], part[:, None], acc)
    if LATE:
        acc = tl.sum(acc3, axis=2)
    ok = n_ok[:, None] & (offs_m < M)[None, :]
    tl.store(OUT + offs_m[None, :] * stride_o + n[:, None], acc.to(OUT.dtype.element_ty), mask=ok)


def reg_rows(x, w, out, block_n, warps, vec, late):
    M, K = x.shape
    N = w.shape[0]
    _reg_rows_kernel[(triton.cdiv(N, block_n),)](x, w, out, M, N, K, x.stride(0), out.stride(0),
                                                 KP=triton.next_power_of_2(K), BLOCK_N=block_n,
                                                 M_PAD=triton.next_power_of_2(M), VEC=vec, LATE=late,
                                                 num_warps=warps)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--configs", default="4x8x8,2x8x8,8x8x8,4x16x8,8x16x8,4x8x16")  # BLOCK_NxWARPSxVEC
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gu": (28672, 4096), "down": (4096, 14336)}
    ws = {k: [torch.randn(n, kk, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(args.layers)]
          for k, (n, kk) in shapes.items()}
    res = []
    for M in (int(m) for m in args.rows.split(",")):
        for kind, (N, K) in shapes.items():
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            gb = N * K * 2 * args.layers / 1e9
            rec = {"M": M, "kind": kind}
            ms = time_fn(lambda: [F.linear(x, w) for w in ws[kind]], 20)
            rec["cublas_us"] = ms * 1e3 / args.layers
            rec["cublas_tb_s"] = gb / ms
            ref = F.linear(x.float(), ws[kind][0].float())
            for c in args.configs.split(","):
                bn, wp, vec = (int(v) for v in c.split("x"))
                if bn * triton.next_power_of_2(K) > 128 * 32 * wp:
                    continue
                for late in (False, True):
                    key = f"{c}{'L' if late else ''}"
                    try:
                        reg_rows(x, ws[kind][0], out, bn, wp, vec, late)
                        err = (out.float() - ref).abs().max().item()
                        ms = time_fn(lambda: [reg_rows(x, w, out, bn, wp, vec, late) for w in ws[kind]], 20)
                        rec[key + "_us"] = ms * 1e3 / args.layers
                        rec[key + "_err"] = err
                    except Exception as e:  # noqa: BLE001
                        rec[key + "_error"] = f"{type(e).__name__}: {e}"[:200]
            res.append(rec)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rec.items() if not k.endswith("_err")},
                  flush=True)
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
