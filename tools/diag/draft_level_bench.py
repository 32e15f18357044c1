"""Does an FP8 draft level run faster on the register kernel (`eyas.kernels.decode_linear` with `scale=`, PDL) than
on the FP8 GEMV (`eyas.kernels.gemv`: what the levels took before session 24, and what more than
`eyas.layers.linear_fp8.ROW_KERNEL_MAX_ROWS` rows take)? (GPU only; sm_90 for PDL.)

    PYTHONPATH=. python3 tools/diag/draft_level_bench.py [--rows 4] --out /tmp/level.json

One Llama-3.1-8B draft level's linears at `--rows` rows of x (1 by default; a chain's catch-up has up to 4), each
alone as `tools/diag/gemv_fp8_bench.py` times them (weights cycled through > 400 MB of copies in a CUDA graph of one
cycle, so that L2 holds none): fc (4096 x 8192), qkv (6144 x 4096, timed as a plain linear), o (4096 x 4096,
residual added), gate_up (28672 x 4096: RMSNorm and SwiGLU folded in), down (4096 x 14336, residual added) and the
32k draft vocabulary's head (32768 x 4096). For each: the FP8 GEMV's default config (without the small kernels it
leaves to others), `decode_linear` over the FP8 codes at each config of `--configs` (BLOCK_NxWARPS) with PDL, and
`decode_linear` over bf16 weights at its default config (the register kernel's speed on twice the bytes). Each
result is checked against its reference first. Prints us a call and the bytes streamed per second; the last line
sums a level's best.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_bench import time_cycle, weight_copies  # noqa: E402

from eyas.kernels.decode_linear import (DecodeLinearConfig, decode_linear, decode_linear_reference,  # noqa: E402
                                        default_decode_config)
from eyas.kernels.gemv import gemv_reference, gemv_triton  # noqa: E402
from eyas.layers.linear_fp8 import quantize_fp8  # noqa: E402

# name -> (N, K, kind): kind as decode_linear's prologue/epilogue
SHAPES = {"fc": (4096, 8192, "plain"), "qkv": (6144, 4096, "plain"), "o": (4096, 4096, "residual"),
          "gate_up": (28672, 4096, "norm+swiglu"), "down": (4096, 14336, "residual"), "head_32k": (32768, 4096, "plain")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--configs", default="2x8,4x4,4x8,8x8,16x16",
                    help="BLOCK_NxWARPS register-kernel configs for the FP8 codes")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--rows", type=int, default=1, help="rows of x (a chain's catch-up level: up to 4)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    dev, dt = torch.device("cuda"), torch.bfloat16
    pdl = not args.no_pdl
    rows = []
    for name in args.shapes.split(","):
        N, K, kind = SHAPES[name]
        ws = weight_copies(N, K, dev, dt)
        copies = len(ws)
        qs = [quantize_fp8(w) for w in ws]
        g = torch.Generator(device=dev).manual_seed(N + K)
        M = args.rows
        x = torch.randn(M, K, device=dev, generator=g).to(dt)
        n_out = N // 2 if "swiglu" in kind else N
        kw = {}
        if "norm" in kind:
            kw["norm_weight"] = (torch.randn(K, device=dev, generator=g) * 0.1 + 1).to(dt)
        if "swiglu" in kind:
            kw["swiglu"] = True
        res = torch.randn(M, n_out, device=dev, generator=g).to(dt) if "residual" in kind else None
        out = torch.empty(M, n_out, device=dev, dtype=dt)
        fp8_bytes = N * K + 4 * N
        row = {"shape": name, "N": N, "K": K, "M": M, "kind": kind, "copies": copies}
        print(f"\n{name} N={N} K={K} ({kind}): {copies} copies, fp8 {fp8_bytes / 1e6:.0f} MB", flush=True)

        row["gemv_fp8_us"] = time_cycle(lambda i: gemv_triton(x, qs[i][0], scale=qs[i][1]), copies)
        cfg_bf = default_decode_config(n_out, K, "swiglu" in kind, M)

        def bf(i):
            return decode_linear(x, ws[i], residual=res, out=out, pdl=pdl, config=cfg_bf, **kw)
        row["decode_bf16_us"] = time_cycle(bf, copies)
        ref = decode_linear_reference(x, qs[0][0], scale=qs[0][1], residual=res, **kw).float()
        best = None
        cfgs = [default_decode_config(n_out, K, "swiglu" in kind, M, weight_bytes=1)]
        for c in args.configs.split(","):
            bn, wp = (int(v) for v in c.split("x"))
            if "swiglu" in kind and bn < 2:
                continue
            cfgs.append(DecodeLinearConfig(BLOCK_N=bn, num_warps=wp))
        for c in dict.fromkeys(cfgs):
            def fn(i, c=c):
                return decode_linear(x, qs[i][0], scale=qs[i][1], residual=res, out=out, pdl=pdl, config=c, **kw)
            try:
                got = fn(0).float()
                torch.testing.assert_close(got, ref, rtol=2 ** -6, atol=2e-2 * ref.abs().max().item())
                us = time_cycle(fn, copies)
            except Exception as e:  # a config that does not compile (registers) or is wrong: reported, skipped
                print(f"    {c}: {type(e).__name__}: {str(e)[:140]}")
                continue
            key = f"{c.BLOCK_N}x{c.num_warps}"
            row.setdefault("decode_fp8_us", {})[key] = us
            if c == cfgs[0]:
                row["decode_fp8_default"], row["decode_fp8_default_us"] = key, us
            if best is None or us < best[0]:
                best = (us, key)
        if best:
            row["decode_fp8_best_us"], row["decode_fp8_best"] = best
        tb = lambda us, b: b / (us * 1e-6) / 1e12  # noqa: E731
        print(f"  gemv fp8 {row['gemv_fp8_us']:.1f} us ({tb(row['gemv_fp8_us'], fp8_bytes):.2f} TB/s) | decode bf16 "
              f"{row['decode_bf16_us']:.1f} us ({tb(row['decode_bf16_us'], 2 * N * K):.2f} TB/s) | decode fp8 "
              f"default {row.get('decode_fp8_default', '-')} {row.get('decode_fp8_default_us', float('nan')):.1f} us, "
              f"best {row.get('decode_fp8_best', '-')} {row.get('decode_fp8_best_us', float('nan')):.1f} us "
              f"({tb(row.get('decode_fp8_best_us', float('nan')), fp8_bytes):.2f} TB/s)", flush=True)
        print("    " + "  ".join(f"{k} {v:.1f}" for k, v in row.get("decode_fp8_us", {}).items()), flush=True)
        rows.append(row)
        del ws, qs
        torch.cuda.empty_cache()
    total = {k: sum(r.get(k, float("nan")) for r in rows)
             for k in ("gemv_fp8_us", "decode_bf16_us", "decode_fp8_default_us", "decode_fp8_best_us")}
    print("\none level: " + ", ".join(f"{k} {v:.1f}" for k, v in total.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "pdl": pdl, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                              "rows": rows, "level_us": total}, indent=2))


if __name__ == "__main__":
    main()
