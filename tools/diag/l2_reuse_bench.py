"""The register kernel (eyas decode_linear, one row) reading its weight from HBM against from L2, on the H200.

    PYTHONPATH=. python3 tools/diag/l2_reuse_bench.py OUT.json

For four 8B-shaped weights: 16 launches captured in a CUDA graph, on 16 distinct weights (each read from HBM) or
16 times on one (read from L2 after the first, where it fits the 60 MB), without and with PDL; us a launch, the best
of 5 rounds of 10 replays, each round after a 256 MB write that flushes L2. Session 45's call 6 ran it (as
l2_reuse_bench_tmp.py, this code; docs/benchmarks.md, "Session 45"): the o weight 6.03 us from L2 against 9.36 from
HBM with PDL. It motivated the L2 prefetch of the o weight that then lost (0cacb10); a record, not a fast path.
"""
import json, sys, torch
from eyas.kernels.decode_linear import decode_linear
torch.manual_seed(0)
dev = "cuda"
res = {}
for name, (N, K) in {"o": (4096, 4096), "qkv": (6144, 4096), "half_gu": (14336, 4096), "small": (2048, 4096)}.items():
    L = 16
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)]
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    outs = [torch.empty(1, N, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    for pdl in (False, True):
        for mode in ("distinct", "same"):
            def body():
                for i in range(L):
                    w = ws[i] if mode == "distinct" else ws[0]
                    decode_linear(x, w, out=outs[i], pdl=pdl)
            body(); torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            for _ in range(3): g.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            best = 1e9
            for r in range(5):
                # flush L2 by touching a big buffer
                big = torch.empty(256 << 20, dtype=torch.uint8, device=dev); big.zero_()
                e0.record(); 
                for _ in range(10): g.replay()
                e1.record(); torch.cuda.synchronize()
                best = min(best, e0.elapsed_time(e1) * 1000 / 10 / L)
            res[f"{name} pdl={pdl} {mode}"] = round(best, 2)
            print(name, f"N={N} K={K} {N*K*2/1e6:.1f} MB", "pdl" if pdl else "nopdl", mode, f"{best:.2f} us", f"{N*K*2/best/1e6:.2f} TB/s", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
