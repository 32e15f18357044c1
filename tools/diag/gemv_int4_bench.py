"""Does an INT4 draft head or FFN pay on the H200? cuBLAS over bf16 weights (F.linear) against the two INT4 GEMVs on
the same shapes: PyTorch's tinygemm (`_weight_int4pack_mm`, what `Int4Linear` runs on CUDA) and eyas's Triton kernel
(eyas/kernels/gemv_int4.py: its default config and a small sweep), at M = 1 and 4.

    PYTHONPATH=. python3 tools/diag/gemv_int4_bench.py --out /tmp/int4.json      # from the repo root, on a GPU

Shapes: the Llama-3.1-8B draft's LM head (128256 x 4096), gate_up (28672 x 4096) and down (4096 x 14336), and
SmolLM2's head (49152 x 576). Weights cycle through enough copies (> 400 MB, the head 4) that L2 holds none, in a
CUDA graph of one cycle (`tools/diag/gemv_bench.time_cycle`). Every INT4 result is checked against the dequantised
reference first. Prints us per call and the weight bytes each streams per second (bf16: 2 bytes a weight; INT4: half
a byte plus the scales and zeros).
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

from eyas.kernels.gemv_int4 import default_int4_config, gemv_int4_reference, gemv_int4_triton  # noqa: E402
from eyas.layers.linear_int4 import Int4Linear  # noqa: E402

SHAPES = {"lm_head_8b": (128256, 4096), "gate_up_8b": (28672, 4096), "down_8b": (4096, 14336),
          "lm_head_smollm2": (49152, 576)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        ws = weight_copies(N, K, dev, dt)
        copies = len(ws)
        qs = [Int4Linear(w, None, args.group_size) for w in ws]
        for q in qs:
            q.prepare(dev, dt)
        g = qs[0].group_size
        int4_bytes = N * K // 2 + qs[0].scales_and_zeros.numel() * 2  # bf16 scales and zeros in the kernels
        print(f"\n{name} N={N} K={K} group {g}: {copies} copies; bf16 {N * K * 2 / 1e6:.0f} MB, int4 "
              f"{int4_bytes / 1e6:.0f} MB each", flush=True)
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=dt)
            ref = gemv_int4_reference(x, qs[0].qweight, qs[0].scales_and_zeros, g).float()
            tol = 0.02 * ref.abs().max().item()
            row = {"shape": name, "N": N, "K": K, "M": M, "group_size": g}
            row["cublas_bf16_us"] = time_cycle(lambda i: F.linear(x, ws[i]), copies)
            torch.testing.assert_close(qs[0](x).float(), ref, rtol=0.02, atol=tol)
            row["tinygemm_us"] = time_cycle(lambda i: qs[i](x), copies)
            szs = [q.scales_and_zeros.to(dt).contiguous() for q in qs]
            bn, sk = default_int4_config(M, N, K, g)
            configs = [(bn, sk, 4, 3)]
            if not args.no_sweep:
                for block_n in {max(1, bn // 2), bn, bn * 2}:
                    for split in {max(1, sk // 2), sk, min(16, sk * 2)}:
                        for warps, stages in ((4, 3), (8, 3), (4, 5)):
                            configs.append((block_n, split, warps, stages))
            best = None
            for c in dict.fromkeys(configs):
                def fn(i, c=c):
                    return gemv_int4_triton(x, qs[i].qweight, szs[i], g, block_n=c[0], split_k=c[1],
                                            num_warps=c[2], num_stages=c[3])
                try:
                    torch.testing.assert_close(fn(0).float(), ref, rtol=0.02, atol=tol)
                    us = time_cycle(fn, copies)
                except Exception as e:  # a config that does not compile or is wrong: reported, skipped
                    print(f"    triton {c}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if c == configs[0]:
                    row["triton_default_us"], row["triton_default_config"] = us, list(c)
                if best is None or us < best[0]:
                    best = (us, list(c))
            if best:
                row["triton_best_us"], row["triton_best_config"] = best
            for k in ("cublas_bf16_us", "tinygemm_us", "triton_default_us", "triton_best_us"):
                if k in row:
                    nbytes = N * K * 2 if k.startswith("cublas") else int4_bytes
                    row[k.replace("_us", "_tb_s")] = nbytes / (row[k] * 1e-6) / 1e12
            rows.append(row)
            print("  M=%d: cuBLAS bf16 %.1f us (%.2f TB/s) | tinygemm %.1f us (%.2f TB/s) | triton default %s us "
                  "| best %s us %s" % (M, row["cublas_bf16_us"], row["cublas_bf16_tb_s"], row["tinygemm_us"],
                                      row["tinygemm_tb_s"], f"{row.get('triton_default_us', float('nan')):.1f}",
                                      f"{row.get('triton_best_us', float('nan')):.1f}", row.get("triton_best_config")),
                  flush=True)
        del ws, qs
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                              "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
