"""Does an FP8 draft pay on the H200? cuBLAS over bf16 weights (F.linear) against eyas's Triton GEMV over FP8 codes
with a scale per row (`eyas.kernels.gemv`, `scale=`: what `Fp8Linear` runs at up to 16 rows), its default config and
a small sweep (with, at M <= 2, the float16-sum variant `GemvConfig.half_acc`), on one 8B-shaped draft level's
linears. With `--scaled-mm`, also cuBLAS's FP8 GEMM (`torch._scaled_mm`, row-wise scales: x quantized to e4m3 per
row and padded to 16 rows, W8A8), timed with and without the activation's quantization.

    PYTHONPATH=. python3 tools/diag/gemv_fp8_bench.py --out /tmp/fp8.json      # from the repo root, on a GPU

Shapes: the Llama-3.1-8B draft's fc (4096 x 8192), qkv (6144 x 4096), o (4096 x 4096), gate_up (28672 x 4096), down
(4096 x 14336) and a 32k-token draft vocabulary's head (32768 x 4096). Weights cycle through > 400 MB of copies,
so that L2 holds none, in a CUDA graph of one cycle (`tools/diag/gemv_bench.time_cycle`). Each FP8 result is checked
against the dequantised reference first. Prints us per call and the bytes each streams per second (bf16: 2 bytes a
weight; FP8: 1, plus 4 bytes of scale a row).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_bench import time_cycle, weight_copies  # noqa: E402

from eyas.kernels.gemv import GemvConfig, default_config, gemv_reference, gemv_triton  # noqa: E402
from eyas.layers.linear_fp8 import quantize_fp8  # noqa: E402

SHAPES = {"fc": (4096, 8192), "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "head_32k": (32768, 4096)}
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), all on the tensor-core path (FP8 codes widened to float16)
SWEEP = [(bn, bk, sk, w, st) for bn, bk in ((64, 128), (32, 256), (64, 256), (128, 128), (16, 512), (32, 512))
         for sk in (1, 2, 4) for w, st in ((4, 4), (8, 3))]
# the elementwise path with float16 products and sums (GemvConfig.half_acc), at M <= 2
SWEEP_HALF = [(bn, bk, sk, w, 4) for bn, bk in ((8, 1024), (16, 512), (16, 1024), (32, 512), (4, 2048))
              for sk in (1, 2, 4) for w in (4, 8)]

def quantize_rows(x: torch.Tensor, pad: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M', K], float32 scales [M', 1]) with M' = M rounded up to `pad` (zero rows)."""
    M, K = x.shape
    Mp = -(-M // pad) * pad
    xp = x.new_zeros(Mp, K)
    xp[:M] = x
    amax = xp.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    s = amax / torch.finfo(torch.float8_e4m3fn).max
    return (xp.float() / s).to(torch.float8_e4m3fn), s


def scaled_mm_row(row: dict, x: torch.Tensor, qs, copies: int, ref: torch.Tensor) -> None:
    """cuBLAS's FP8 GEMM on the weight codes (row-wise scales), x quantized per row: its us alone and with the
    quantization, into `row` (checked against the bf16-activation reference at a W8A8 tolerance first)."""
    M = x.shape[0]
    xq, xs = quantize_rows(x)
    ws = [(q, s.view(1, -1)) for q, s in qs]

    def mm(i):
        return torch._scaled_mm(xq, ws[i][0].t(), scale_a=xs, scale_b=ws[i][1], out_dtype=torch.bfloat16)

    def mm_quant(i):
        a, sa = quantize_rows(x)
        return torch._scaled_mm(a, ws[i][0].t(), scale_a=sa, scale_b=ws[i][1], out_dtype=torch.bfloat16)

    try:
        out = mm(0)[:M].float()
        err = ((out - ref).norm() / ref.norm()).item()
        row["scaled_mm_rel_err"] = err
        row["scaled_mm_us"] = time_cycle(mm, copies)
        row["scaled_mm_quant_us"] = time_cycle(mm_quant, copies)
    except Exception as e:  # not every torch build has row-wise scales
        print(f"    _scaled_mm: {type(e).__name__}: {str(e)[:160]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--scaled-mm", action="store_true", help="also torch._scaled_mm (W8A8, row-wise scales)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        ws = weight_copies(N, K, dev, dt)
        copies = len(ws)
        qs = [quantize_fp8(w) for w in ws]
        fp8_bytes = N * K + 4 * N
        print(f"\n{name} N={N} K={K}: {copies} copies; bf16 {N * K * 2 / 1e6:.0f} MB, fp8 {fp8_bytes / 1e6:.0f} MB",
              flush=True)
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=dt)
            ref = gemv_reference(x, qs[0][0], scale=qs[0][1]).float()
            row = {"shape": name, "N": N, "K": K, "M": M}
            row["cublas_bf16_us"] = time_cycle(lambda i: F.linear(x, ws[i]), copies)
            if args.scaled_mm:
                scaled_mm_row(row, x, qs, copies, ref)
            d = default_config(M, N, K, dt, weight_dtype=torch.float8_e4m3fn)
            configs = [d] + ([] if args.no_sweep else
                             [GemvConfig(*c[:3], num_warps=c[3], num_stages=c[4], use_dot=True) for c in SWEEP]
                             + [GemvConfig(*c[:3], num_warps=c[3], num_stages=c[4], half_acc=True)
                                for c in (SWEEP_HALF if M <= 2 else [])])
            best = None
            for c in dict.fromkeys(configs):
                def fn(i, c=c):
                    return gemv_triton(x, qs[i][0], config=c, scale=qs[i][1])
                try:
                    torch.testing.assert_close(fn(0).float(), ref, rtol=2 ** -7, atol=2e-3 * ref.abs().max().item())
                    us = time_cycle(fn, copies)
                except Exception as e:  # a config that does not compile or is wrong: reported, skipped
                    print(f"    {c}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                cfg = [c.BLOCK_N, c.BLOCK_K, c.SPLIT_K, c.num_warps, c.num_stages, c.use_dot, c.half_acc]
                if c == d:
                    row["fp8_default_us"], row["fp8_default_config"] = us, cfg
                if best is None or us < best[0]:
                    best = (us, cfg)
                if c.half_acc and ("fp8_half_best_us" not in row or us < row["fp8_half_best_us"]):
                    row["fp8_half_best_us"], row["fp8_half_best_config"] = us, cfg
            if best:
                row["fp8_best_us"], row["fp8_best_config"] = best
            for k in ("cublas_bf16_us", "fp8_default_us", "fp8_best_us", "scaled_mm_us", "scaled_mm_quant_us"):
                if k in row:
                    nbytes = N * K * 2 if k.startswith("cublas") else fp8_bytes
                    row[k.replace("_us", "_tb_s")] = nbytes / (row[k] * 1e-6) / 1e12
            rows.append(row)
            print("  M=%d: cuBLAS bf16 %.1f us (%.2f TB/s) | fp8 default %s us | best %s us (%s TB/s) %s | float16 "
                  "sums %s us" % (
                      M, row["cublas_bf16_us"], row["cublas_bf16_tb_s"],
                      f"{row.get('fp8_default_us', float('nan')):.1f}", f"{row.get('fp8_best_us', float('nan')):.1f}",
                      f"{row.get('fp8_best_tb_s', float('nan')):.2f}", row.get("fp8_best_config"),
                      f"{row.get('fp8_half_best_us', float('nan')):.1f}"), flush=True)
            if "scaled_mm_us" in row:
                print("       _scaled_mm %.1f us (%.2f TB/s), with x's quantization %.1f us" % (
                    row["scaled_mm_us"], row["scaled_mm_tb_s"], row["scaled_mm_quant_us"]), flush=True)
        del ws, qs
        torch.cuda.empty_cache()
    total = {k: sum(r[k] for r in rows if r["M"] == 1 and k in r)
             for k in ("cublas_bf16_us", "fp8_default_us", "fp8_best_us", "fp8_half_best_us", "scaled_mm_us",
                       "scaled_mm_quant_us")}
    print(f"\none draft level at M=1 (the shapes above): cuBLAS bf16 {total['cublas_bf16_us']:.1f} us, FP8 default "
          f"{total['fp8_default_us']:.1f} us, best {total['fp8_best_us']:.1f} us, best with float16 sums "
          f"{total['fp8_half_best_us']:.1f} us" + (f"; _scaled_mm {total['scaled_mm_us']:.1f} us, with x's "
                                                   f"quantization {total['scaled_mm_quant_us']:.1f}"
                                                   if args.scaled_mm else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                              "rows": rows, "level_m1_us": total}, indent=2))


if __name__ == "__main__":
    main()
