"""Do the tile kernels (eyas.kernels.decode_linear, 2-64 rows) beat cuBLAS plus the small kernels on verify-pass
shapes? (GPU only.)

    PYTHONPATH=. python3 tools/diag/tile_chain_bench.py --shape 8b --rows 4,16 --per-kind --out /tmp/tile.json

A synthetic forward of M rows (a verify pass: 4 for `chain:3`, 49 for SmolLM2's default tree) over distinct bf16
weights of a real shape (`8b`: Llama-3.1-8B, 15 GB, so L2 holds none of it between forwards; `smollm2`: 30 layers
of 576), captured in one CUDA graph and replayed; ms per forward. Each layer's attention is stood in for by one
copy kernel (q's first H columns to the attention output), as in decode_chain_bench.py; its real cost comes on
top of every variant alike.

* `cublas + small kernels`: what the fused path launches (add + RMSNorm, F.linear, SwiGLU);
* `decode_linear`: its kernels with the norm prologue and the residual / SwiGLU epilogues (PDL on sm_90), default
  configs (`default_config`: the register kernel for 1-2 rows, the tile kernel for more). Session 15's raw
  results (docs/bench/few_rows_s15.json) name these rows "tile (...)": at that time, before the two-row rule, only
  one row took the register kernel;
* `--per-kind`: each linear kind alone (32 launches over the layers' weights; `qkv_rope` is decode_qkv_rope with its
  RoPE epilogue into a stash, a verify pass's launch, beside cuBLAS's bare qkv GEMM) for cuBLAS and every config of
  `--configs` (BLOCK_NxBLOCK_KxWARPSxSTAGES[xBLOCK_M[x1]], x1: first_w; rBLOCK_NxWARPS: the register kernel, up to 8 rows); then the
  chain again with each kind's best.
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

from eyas.kernels.decode_linear import (REGISTER_ROWS, DecodeLinearConfig, TileConfig, decode_linear, decode_qkv_rope,
                                       default_config)
from eyas.kernels.fused_norm import add_rms_norm_triton
from eyas.kernels.swiglu import swiglu_triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_chain_bench import fits, layer_errors, time_fn  # noqa: E402

SHAPES = {"8b": dict(H=4096, QKV=6144, I=14336, V=128256, L=32, NQ=32, KVH=8, D=128),
          "smollm2": dict(H=576, QKV=960, I=1536, V=49152, L=30, NQ=9, KVH=3, D=64)}


def make_weights(dev, s, layers):
    g = torch.Generator(device=dev).manual_seed(0)
    H, QKV, I = s["H"], s["QKV"], s["I"]

    def w(n, k):
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02

    def nw():
        return 1 + 0.1 * torch.randn(H, device=dev, dtype=torch.bfloat16, generator=g)

    return [dict(qkv=w(QKV, H), o=w(H, H), gu=w(2 * I, H), down=w(H, I), n1=nw(), n2=nw()) for _ in range(layers)]


def fwd_cublas_ops(x, ws, H, I, attn):
    hid, res = x, None
    for L in ws:
        h, res = add_rms_norm_triton(hid, res, L["n1"], 1e-5)
        q = F.linear(h, L["qkv"])
        attn.copy_(q[:, :H])
        a = F.linear(attn, L["o"])
        h, res = add_rms_norm_triton(a, res, L["n2"], 1e-5)
        gate, up = F.linear(h, L["gu"]).chunk(2, dim=-1)
        hid = F.linear(swiglu_triton(gate, up), L["down"])
    return hid


def fwd_tile(x, ws, H, attn, bufs, pdl, cfgs):
    r, q, act = bufs
    r.copy_(x)
    for L in ws:
        decode_linear(r, L["qkv"], norm_weight=L["n1"], out=q, pdl=pdl, config=cfgs.get("qkv"))
        attn.copy_(q[:, :H])
        decode_linear(attn, L["o"], residual=r, out=r, pdl=pdl, config=cfgs.get("o"))
        decode_linear(r, L["gu"], norm_weight=L["n2"], swiglu=True, out=act, pdl=pdl, config=cfgs.get("gu"))
        decode_linear(act, L["down"], residual=r, out=r, pdl=pdl, config=cfgs.get("down"))
    return r


def parse_cfg(text):
    """"BxKxWxS[xM[x1]]" -> TileConfig (M: BLOCK_M, rows per program, 0 or none: all; x1: first_w, the first K
    tile's weights loaded before the PDL wait); "rBxW" -> the register kernel,
    DecodeLinearConfig(B, W) (up to 8 rows)."""
    if text.startswith("r"):
        bn, w = (int(v) for v in text[1:].split("x"))
        return DecodeLinearConfig(BLOCK_N=bn, num_warps=w, trigger="end")
    return TileConfig(*(int(v) for v in text.split("x")))


def cfg_name(c):
    if isinstance(c, DecodeLinearConfig):
        return f"r{c.BLOCK_N}x{c.num_warps}"
    return f"{c.BLOCK_N}x{c.BLOCK_K}x{c.num_warps}x{c.num_stages}" + (f"x{c.BLOCK_M}" if c.BLOCK_M or c.first_w else
                                                                     "") + ("x1" if c.first_w else "")


def usable(cfg, M, K, swiglu):
    """Tile configs need >= 16 of each half for pairs; register configs <= REGISTER_ROWS rows and what
    decode_chain_bench's `fits` allows (<= 128 weights a thread, a pair for SwiGLU)."""
    if isinstance(cfg, DecodeLinearConfig):
        return M <= REGISTER_ROWS and fits(cfg, K, swiglu)
    return cfg.BLOCK_N >= 32 or not swiglu


def bench(shape, M, args, dev, result):
    s = SHAPES[shape]
    H, QKV, I = s["H"], s["QKV"], s["I"]
    layers = args.layers or s["L"]
    ws = make_weights(dev, s, layers)
    nbytes = sum(t.numel() * 2 for L in ws for k, t in L.items() if k in ("qkv", "o", "gu", "down"))
    x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    attn = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    bufs = (torch.empty(M, H, device=dev, dtype=torch.bfloat16), torch.empty(M, QKV, device=dev, dtype=torch.bfloat16),
            torch.empty(M, I, device=dev, dtype=torch.bfloat16))
    pdl = torch.cuda.get_device_capability(dev)[0] >= 9
    tag = {"shape": shape, "M": M, "gb": nbytes / 1e9, "layers": layers}
    tag["max_abs_err"] = layer_errors(ws[0], torch.randn(M, H, device=dev, dtype=torch.bfloat16),
                                      torch.randn(M, I, device=dev, dtype=torch.bfloat16), pdl)
    print(shape, M, "max |decode_linear - reference|:", tag["max_abs_err"], flush=True)

    def chain_row(name, fn):
        try:
            ms = min(time_fn(fn, args.reps), time_fn(fn, args.reps))
            row = {**tag, "variant": name, "ms": ms, "tb_s": nbytes / ms / 1e9}
        except Exception as e:  # noqa: BLE001 - record and go on
            row = {**tag, "variant": name, "error": f"{type(e).__name__}: {e}"[:500]}
        result["rows"].append(row)
        print({k: v for k, v in row.items() if k != "max_abs_err"}, flush=True)

    chain_row("cublas + small kernels", lambda: fwd_cublas_ops(x, ws, H, I, attn))
    chain_row("decode_linear (default configs)", lambda: fwd_tile(x, ws, H, attn, bufs, pdl, {}))
    chain_row("decode_linear (default configs), no PDL", lambda: fwd_tile(x, ws, H, attn, bufs, False, {}))
    if not args.per_kind:
        return
    kinds = {"qkv": dict(norm=True), "o": dict(res=True), "gu": dict(norm=True, swiglu=True), "down": dict(res=True),
             "qkv_rope": dict(norm=True, swiglu=True)}   # (qkv_rope: pairs, as SwiGLU's, for `usable`)
    # qkv_rope: the verify pass's launch, decode_qkv_rope into a stash (one sequence of M tokens at rows 1 .. M)
    D, KVH, NQ = s["D"], s["KVH"], s["NQ"]
    t = torch.arange(4096, device=dev, dtype=torch.float32)[:, None] / 10000 ** (
        torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D)
    cos, sin = (torch.cat([f(t), f(t)], dim=-1).contiguous() for f in (torch.cos, torch.sin))
    pos = torch.arange(100, 100 + M, device=dev)
    kd, vd = (torch.zeros(M + 2, KVH, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    xin = {"qkv": bufs[0], "o": attn, "gu": bufs[0], "down": bufs[2], "qkv_rope": bufs[0]}
    outs = {"qkv": bufs[1], "o": bufs[0], "gu": bufs[2], "down": bufs[0]}
    best = {}
    for kind, opt in kinds.items():
        wk = "qkv" if kind == "qkv_rope" else kind
        kb = sum(L[wk].numel() * 2 for L in ws)

        def cub(kind=kind):
            for L in ws:
                F.linear(xin[kind], L[wk])
        ms = time_fn(cub, args.reps)
        N, K = ws[0][wk].shape
        dflt = default_config(M, N // 2 if opt.get("swiglu") else N, K, pairs=opt.get("swiglu", False))
        rec = {**{k: v for k, v in tag.items() if k != "max_abs_err"}, "kind": kind,
               "cublas_us": ms * 1e3 / len(ws), "cublas_tb_s": kb / ms / 1e9, "default": cfg_name(dflt)}
        for c in [cfg_name(dflt)] + [c for c in args.configs.split(",") if c and c != cfg_name(dflt)]:
            cfg = parse_cfg(c)
            if not usable(cfg, M, K, opt.get("swiglu", False)):
                continue

            def run(kind=kind, cfg=cfg):
                if kind == "qkv_rope":
                    for L in ws:
                        decode_qkv_rope(xin[kind], L["qkv"], L["n1"], 1e-5, pos, None, cos, sin, kd, vd, NQ,
                                        seq_rows=M + 2, row_offset=1, seq_q=M, pdl=pdl, config=cfg)
                    return
                for L in ws:
                    decode_linear(xin[kind], L[kind], norm_weight=L["n1"] if opt.get("norm") else None,
                                  residual=bufs[0] if opt.get("res") else None, swiglu=opt.get("swiglu", False),
                                  out=outs[kind], pdl=pdl, config=cfg)
            try:
                us = time_fn(run, args.reps) * 1e3 / len(ws)
                rec[f"{c}_us"] = us
                if us < best.get(kind, (1e9,))[0]:
                    best[kind] = (us, cfg)
            except Exception as e:  # noqa: BLE001
                rec[f"{c}_error"] = f"{type(e).__name__}: {e}"[:300]
        rec["best"] = cfg_name(best[kind][1]) if kind in best else None
        result["per_kind"].append(rec)
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
    bc = {k: c for k, (_, c) in best.items()}
    chain_row("decode_linear (best per kind): " + ",".join(f"{k}={cfg_name(c)}" for k, c in bc.items()),
              lambda: fwd_tile(x, ws, H, attn, bufs, pdl, bc))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8b", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--rows", default="4", help="comma-separated row counts (2-64)")
    ap.add_argument("--layers", type=int, default=0, help="0: the shape's own")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--per-kind", action="store_true")
    ap.add_argument("--configs", default="16x128x4x4,16x256x4x4,32x128x4x4,32x256x4x3,64x128x4x3,64x128x8x3,"
                                          "16x512x4x3,32x64x4x5")
    ap.add_argument("--separate-pairs", action="store_true",
                    help="whole-K tiles (BLOCK_K 0) load SwiGLU's pairs as two tiles (JOINED_PAIRS = False)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.separate_pairs:
        import eyas.kernels.decode_linear as dl
        dl.JOINED_PAIRS = False
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": [], "per_kind": []}
    for shape in args.shape.split(","):
        for M in (int(m) for m in args.rows.split(",")):
            bench(shape, M, args, dev, result)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
