"""Do the verify passes' GEMMs run faster on cuBLASLt than on cuBLAS? (GPU only.)

    PYTHONPATH=. python3 tools/diag/blas_pref_bench.py --out /tmp/blas_pref.json

The verify passes that stay on cuBLAS (the 8B shape's `chain:3` at 4 rows and its batch-32 rows, SmolLM2's default
tree at 49 rows) run each projection as torch's GEMM: `F.linear` (qkv, gate/up) and, with the residual add folded
in, `residual.addmm_(x, W^T)` (o, down; `eyas.models.llama`). torch sends both to cuBLAS unless
`torch.backends.cuda.preferred_blas_library("cublaslt")`, whose heuristics may pick other kernels (and other split-K
reductions) at these skinny shapes. This times every verify projection both ways, one CUDA graph per case, 32
distinct weights per kind so that L2 holds none between launches, us per launch; the results of the two libraries
are also compared (the largest difference, relative to the largest output).
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
from decode_chain_bench import time_fn  # noqa: E402

# (N, K) of each projection; "add": the residual is added by the GEMM (beta = 1)
SHAPES = {"8b": {"qkv": (6144, 4096, False), "o": (4096, 4096, True), "gate_up": (28672, 4096, False),
                 "down": (4096, 14336, True)},
          "smollm2": {"qkv": (960, 576, False), "o": (576, 576, True), "gate_up": (3072, 576, False),
                      "down": (576, 1536, True)}}
CASES = (("8b", 4), ("8b", 32), ("smollm2", 49), ("smollm2", 4))
COPIES = 32


def bench_case(model: str, M: int, reps: int, libs) -> list[dict]:
    rows = []
    for name, (N, K, add) in SHAPES[model].items():
        g = torch.Generator(device="cuda").manual_seed(0)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
              for _ in range(COPIES)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
        out = torch.empty(COPIES, M, N, device="cuda", dtype=torch.bfloat16)
        row = {"model": model, "M": M, "shape": name, "N": N, "K": K, "residual_add": add}
        results = {}
        for lib in libs:
            torch.backends.cuda.preferred_blas_library(lib)

            def run():
                for i, w in enumerate(ws):
                    if add:
                        out[i].copy_(res)
                        out[i].addmm_(x, w.t())
                    else:
                        torch.mm(x, w.t(), out=out[i])

            # the copy of the residual is timed alone and taken off
            copy_us = 0.0
            if add:
                def copies():
                    for i in range(COPIES):
                        out[i].copy_(res)
                copy_us = time_fn(copies, reps) * 1e3 / COPIES
            us = time_fn(run, reps) * 1e3 / COPIES - copy_us
            row[f"{lib}_us"] = us
            results[lib] = out.clone()
        if len(libs) == 2:
            a, b = (results[lib].float() for lib in libs)
            row["max_rel_diff"] = ((a - b).abs().max() / a.abs().max()).item()
        rows.append(row)
        print(f"{model} M={M:3d} {name:8s} " + "  ".join(f"{lib} {row[f'{lib}_us']:7.2f} us" for lib in libs)
              + (f"  rel diff {row.get('max_rel_diff', 0):.1e}" if len(libs) == 2 else ""), flush=True)
        del ws, out, results
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--libs", nargs="+", default=["cublas", "cublaslt"])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("blas_pref_bench.py needs a GPU")
    rows = []
    for model, M in CASES:
        rows += bench_case(model, M, a.reps, a.libs)
    for model, M in CASES:
        sel = [r for r in rows if r["model"] == model and r["M"] == M]
        print(f"{model} M={M}: a layer's GEMMs " + "  ".join(
            f"{lib} {sum(r[f'{lib}_us'] for r in sel):.1f} us" for lib in a.libs))
    if a.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        Path(a.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
