"""Does the register kernel's K, padded to a power of two, cost SmolLM2's one-row GEMVs? (GPU only.)

    PYTHONPATH=. python3 tools/diag/kpad_gemv_bench.py --out /tmp/kpad.json

Until session 31 `decode_linear`'s register kernel held a [BLOCK_N, next_pow2(K)] weight tile: SmolLM2's K = 576
became 1024, so 44% of the tile's lanes were masked and their threads idle, and its LM head (49,152 x 576) ran at
~2.8 TB/s at one row in the engine (20.3 us; cuBLAS reads it at ~4 TB/s at 8 rows). This times y = x W^T for one row x (no norm, no epilogue):

* `cublas`: F.linear;
* `decode_linear`: the register kernel at its default config, and at BLOCK_N x warps of `--configs`;
* `decode_linear one part`: the same with `EXACT_K` off (one padded part, as before session 31);
* `pad` / `two`: a minimal register GEMV, the same tile held as one padded [BLOCK_N, KP] load (`pad`) or as
  decode_linear's two parts (`two`, `k_parts`: 512 + 64 for 576, 1024 + 512 for 1536), at the same configs;
* `tile`: decode_linear's tile kernel (`tl.dot` over BLOCK_K-wide steps, the row padded to 16).

Weights: distinct copies per kind (>= 3 and > 150 MB) so that L2 holds none between launches, cycled through in
one CUDA graph, us per launch. Every variant is checked against F.linear first.
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

import eyas.kernels.decode_linear as dl
from eyas.kernels.decode_linear import DecodeLinearConfig, TileConfig, decode_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_chain_bench import time_fn  # noqa: E402

KINDS = {"head": (49152, 576), "qkv": (960, 576), "o": (576, 576), "gu": (3072, 576), "down": (576, 1536)}


@triton.jit
def _gemv_kernel(X, W, OUT, N, K, KA: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[n] = sum_k W[n, k] x[k] over BLOCK_N rows; the row held as [0, KA) and [KA, KA + KB) (KB 0: one load,
    masked to K)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(n < N, n, 0).to(tl.int64)
    ka = tl.arange(0, KA)
    wa = tl.load(W + rows[:, None] * K + ka[None, :], mask=(ka < K)[None, :], other=0.0)
    xa = tl.load(X + ka, mask=ka < K, other=0.0)
    acc = tl.sum(wa.to(tl.float32) * xa.to(tl.float32)[None, :], axis=1)
    if KB > 0:
        kb = KA + tl.arange(0, KB)
        wb = tl.load(W + rows[:, None] * K + kb[None, :], mask=(kb < K)[None, :], other=0.0)
        xb = tl.load(X + kb, mask=kb < K, other=0.0)
        acc += tl.sum(wb.to(tl.float32) * xb.to(tl.float32)[None, :], axis=1)
    tl.store(OUT + n, acc.to(OUT.dtype.element_ty), mask=n < N)


def gemv(x, w, out, block_n, warps, two):
    N, K = w.shape
    ka, kb = dl.k_parts(K) if two else (triton.next_power_of_2(K), 0)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, out, N, K, KA=ka, KB=kb, BLOCK_N=block_n, num_warps=warps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--configs", default="4x4,8x4,8x8,16x4,16x8,32x8,32x16",
                    help="BLOCK_NxWARPS for the register variants")
    ap.add_argument("--tiles", default="16x64x4x3,32x64x4x4,64x64x4x4,128x64x8x4",
                    help="BLOCK_NxBLOCK_KxWARPSxSTAGES for the tile kernel")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}
    for kind in args.kinds.split(","):
        N, K = KINDS[kind]
        copies = max(3, -(-150_000_000 // (N * K * 2)))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        rec = {"kind": kind, "N": N, "K": K, "copies": copies, "us": {}, "err": {}}

        def run(name, one):
            try:
                out.zero_()
                one(ws[0])
                err = (out.float() - ref).abs().max().item()
                rec["err"][name] = err
                if err > 0.05:
                    rec["us"][name] = None
                    return
                rec["us"][name] = time_fn(lambda: [one(w) for w in ws], args.reps) * 1000 / copies
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                rec["err"][name] = f"{type(e).__name__}: {str(e)[:120]}"

        run("cublas", lambda w: torch.matmul(x, w.T, out=out))
        run("decode_linear", lambda w: decode_linear(x, w, out=out))
        exact, dl.EXACT_K = dl.EXACT_K, False
        run("decode_linear one part", lambda w: decode_linear(x, w, out=out))
        dl.EXACT_K = exact
        for c in args.configs.split(","):
            b, wp = map(int, c.split("x"))
            cfg = DecodeLinearConfig(BLOCK_N=b, num_warps=wp, trigger="end")
            run(f"decode_linear {c}", lambda w, cfg=cfg: decode_linear(x, w, out=out, config=cfg))
            run(f"pad {c}", lambda w, b=b, wp=wp: gemv(x, w, out, b, wp, False))
            run(f"two {c}", lambda w, b=b, wp=wp: gemv(x, w, out, b, wp, True))
        for t in args.tiles.split(","):
            b, bk, wp, st = map(int, t.split("x"))
            cfg = TileConfig(BLOCK_N=b, BLOCK_K=bk, num_warps=wp, num_stages=st)
            run(f"tile {t}", lambda w, cfg=cfg: decode_linear(x, w, out=out, config=cfg))
        gb = N * K * 2 / 1e9
        best = {}
        for prefix in ("decode_linear ", "pad ", "two ", "tile "):
            cand = {k: v for k, v in rec["us"].items() if k.startswith(prefix) and v is not None}
            if cand:
                k = min(cand, key=cand.get)
                best[prefix.strip()] = (k, round(cand[k], 2), round(gb / cand[k] * 1e6 / 1e3, 2))
        rec["best"] = best
        print(kind, "cublas", round(rec["us"].get("cublas") or -1, 2), "decode_linear default (two parts / one)",
              round(rec["us"].get("decode_linear") or -1, 2), round(rec["us"].get("decode_linear one part") or -1, 2),
              "best (name, us, TB/s):", best, flush=True)
        result["rows"].append(rec)
        del ws
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
