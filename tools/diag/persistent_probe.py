"""Would a persistent verify pass (one launch for all layers, grid barriers between its phases) beat one launch
per kernel for SmolLM2's 49-row tree verify? A feasibility probe for issue #5, point 2a. (GPU only.)

    PYTHONPATH=. python3 tools/diag/persistent_probe.py --out /tmp/persistent.json

SmolLM2's default-tree verify pass is ~817 us of a ~1.18 ms step on the H200: 30 layers of 8 launches (cuBLAS
GEMMs for qkv, o, gate/up and down, RoPE + store, the split attention and its reduction, SwiGLU), ~3.4 us each,
launch- and latency-bound (weights 1-3.5 MB a GEMM, 49 rows). A persistent kernel would keep P programs on the SMs
for the whole pass and separate its phases by grid barriers, each program loading its next weight tile before it
waits. This times the two things that decide whether that pays, with random bf16 weights of SmolLM2's shapes:

* `barrier`: a kernel of P programs doing R grid barriers and nothing else (us a barrier);
* `chain`: the four GEMMs of 30 layers (49 rows: qkv 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536,
  each reading a slice of the previous output, no attention or epilogues) as one persistent kernel with a barrier
  after every GEMM, against the same 120 GEMMs on cuBLAS in one CUDA graph; the persistent result is checked
  against torch first (a barrier that does not hold shows up as wrong numbers).

`--variants w_shared,x_fixed,no_barrier` (added in session 27, not yet run) times each chain config again with one
cost taken out: no HBM reads of weights (every layer reads layer 0's, which stay in L2), inputs that no phase of
the launch wrote, or no barriers. What a phase waits on decides what could beat grid barriers: a dataflow kernel
(tiles waiting on counters, each program's next weights loaded before it waits) pays only if the weights' or the
barriers' share is large. Session 27's L2 prefetch in the whole verify pass gained nothing, a hint that it is not
the weights.

`--dataflow PxBLOCK_NxKCxWARPS,...` (added in session 27, not yet run) times the same chain with no grid barrier:
a counter per GEMM, each tile loading its weights (K in register chunks of KC) before it waits for the previous
GEMM's counter to reach that GEMM's tile count, and programs with no tile in a GEMM going straight on to their next
one (`_dataflow_kernel`). Checked under the interpreter with one program (the interpreter runs programs one after
another, so several that wait on each other would hang) and compiled offline for sm_90 with Triton 3.9 (no local
memory). Run it under `timeout`: if a program were not resident, the others would wait for ever.

The grid barrier: every program arrives on a counter (atomic add, release, after a block barrier) and spins until
it reads (phase + 1) x P (atomic read, acquire); the counter is zeroed before each launch. P <= the SM count, so all
programs are resident (the kernel would deadlock otherwise).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_chain_bench import time_fn  # noqa: E402

ROWS, HIDDEN, INTER, QKV, LAYERS = 49, 576, 1536, 960, 30


@triton.jit
def _grid_barrier(CNT, target):
    tl.debug_barrier()                                   # the program's writes before its arrival
    tl.atomic_add(CNT, 1, sem="release")
    seen = tl.atomic_add(CNT, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(CNT, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _barrier_kernel(CNT, R: tl.constexpr):
    P = tl.num_programs(0)
    for r in range(R):
        _grid_barrier(CNT, (r + 1) * P)


@triton.jit
def _gemm_phase(X, stride_x, W, Y, stride_y, N, K: tl.constexpr, pid, P, M: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[:M, :N] = X[:M, :K] @ W[N, K]^T, output tiles of BLOCK_N columns dealt round-robin to the P programs."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    tiles = tl.cdiv(N, BLOCK_N)
    for t in range(pid, tiles, P):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k < K)[None, :]
            w = tl.load(W + offs_n[:, None] * K + k0 + offs_k[None, :], mask=k_ok, other=0.0)
            x = tl.load(X + offs_m[:, None] * stride_x + k0 + offs_k[None, :], mask=m_ok[:, None] & k_ok, other=0.0,
                        cache_modifier=".cg")  # (written by other programs this launch: from L2, never L1)
            acc = tl.dot(x, tl.trans(w), acc)
        tl.store(Y + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _chain_kernel(X, WQ, WO, WG, WD, BQ, BO, BG, CNT, XC, L: tl.constexpr, M: tl.constexpr, H: tl.constexpr,
                  I: tl.constexpr, NQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, W_SHARED: tl.constexpr = False, X_FIXED: tl.constexpr = False,
                  NO_BARRIER: tl.constexpr = False):
    """L layers of: BQ = X @ WQ^T; BO = BQ[:, :H] @ WO^T; BG = BO @ WG^T; X = BG[:, :I] @ WD^T, a grid barrier after
    each (4 L barriers). Weights [L, N, K] contiguous. The variants (`--variants`, timing only, their results wrong
    by design) take one cost out each: W_SHARED every layer reads layer 0's weights (7 MB, in L2 after the first
    layer: no HBM reads of weights); X_FIXED every phase reads its input from XC (written before the launch) instead
    of the previous phase's output; NO_BARRIER no barriers."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    for layer in range(L):
        base = layer * 4
        wl = 0 if W_SHARED else layer
        xq, sq = (XC, I) if X_FIXED else (X, H)
        xo, so = (XC, I) if X_FIXED else (BQ, NQ)
        xg, sg = (XC, I) if X_FIXED else (BO, H)
        xd, sd = (XC, I) if X_FIXED else (BG, 2 * I)
        _gemm_phase(xq, sq, WQ + wl * NQ * H, BQ, NQ, NQ, H, pid, P, M, BLOCK_M, BLOCK_N, BLOCK_K)
        if not NO_BARRIER:
            _grid_barrier(CNT, (base + 1) * P)
        _gemm_phase(xo, so, WO + wl * H * H, BO, H, H, H, pid, P, M, BLOCK_M, BLOCK_N, BLOCK_K)
        if not NO_BARRIER:
            _grid_barrier(CNT, (base + 2) * P)
        _gemm_phase(xg, sg, WG + wl * 2 * I * H, BG, 2 * I, 2 * I, H, pid, P, M, BLOCK_M, BLOCK_N, BLOCK_K)
        if not NO_BARRIER:
            _grid_barrier(CNT, (base + 3) * P)
        _gemm_phase(xd, sd, WD + wl * H * I, X, H, H, I, pid, P, M, BLOCK_M, BLOCK_N, BLOCK_K)
        if not NO_BARRIER:
            _grid_barrier(CNT, (base + 4) * P)


@triton.jit
def _df_phase(X, stride_x, W, Y, stride_y, CNT, g, need, pid, P, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KC: tl.constexpr):
    """One GEMM of the dataflow chain: Y[:M, :N] = X[:M, :K] @ W[N, K]^T in tiles of BLOCK_N columns. Each tile's
    weights (K in chunks of KC and a remainder, at most 3 chunks) are loaded into registers first; only then does
    the program wait until the previous GEMM's counter CNT[g - 1] reaches `need` (its tile count; g = 0 waits for
    nothing), load X from L2, multiply, store, and count the tile on CNT[g] (release)."""
    NF: tl.constexpr = K // KC
    R: tl.constexpr = K - NF * KC
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_c = tl.arange(0, KC)
    xp = X + offs_m[:, None] * stride_x
    for t in range(pid, N // BLOCK_N, P):
        rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
        wp = W + rows[:, None] * K
        w0 = tl.load(wp + offs_c[None, :])
        if NF > 1:
            w1 = tl.load(wp + KC + offs_c[None, :])
        if NF > 2:
            w2 = tl.load(wp + 2 * KC + offs_c[None, :])
        if R > 0:
            offs_r = tl.arange(0, R)
            wr = tl.load(wp + NF * KC + offs_r[None, :])
        if g > 0:
            seen = tl.atomic_add(CNT + g - 1, 0, sem="acquire")
            while seen < need:
                seen = tl.atomic_add(CNT + g - 1, 0, sem="acquire")
            tl.debug_barrier()
        x0 = tl.load(xp + offs_c[None, :], mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
        acc = tl.dot(x0, tl.trans(w0))
        if NF > 1:
            x1 = tl.load(xp + KC + offs_c[None, :], mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
            acc = tl.dot(x1, tl.trans(w1), acc)
        if NF > 2:
            x2 = tl.load(xp + 2 * KC + offs_c[None, :], mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
            acc = tl.dot(x2, tl.trans(w2), acc)
        if R > 0:
            xr = tl.load(xp + NF * KC + offs_r[None, :], mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
            acc = tl.dot(xr, tl.trans(wr), acc)
        tl.store(Y + offs_m[:, None] * stride_y + rows[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None])
        tl.debug_barrier()                                   # every thread's stores before the count
        tl.atomic_add(CNT + g, 1, sem="release")


@triton.jit
def _dataflow_kernel(X, WQ, WO, WG, WD, BQ, BO, BG, CNT, L: tl.constexpr, M: tl.constexpr, H: tl.constexpr,
                     I: tl.constexpr, NQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     KC: tl.constexpr):
    """`_chain_kernel`'s 4 L GEMMs with no grid barrier: a counter per GEMM (CNT[4 L], zeroed before the launch),
    each tile waiting for the whole previous GEMM (it reads all of its columns) after loading its own weights, and a
    program with no tile in a GEMM going straight on to its next one. All P programs must be resident."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    for layer in range(L):
        g = layer * 4
        _df_phase(X, H, WQ + layer * NQ * H, BQ, NQ, CNT, g, H // BLOCK_N, pid, P, M, NQ, H, BLOCK_M, BLOCK_N, KC)
        _df_phase(BQ, NQ, WO + layer * H * H, BO, H, CNT, g + 1, NQ // BLOCK_N, pid, P, M, H, H, BLOCK_M, BLOCK_N,
                  KC)
        _df_phase(BO, H, WG + layer * 2 * I * H, BG, 2 * I, CNT, g + 2, H // BLOCK_N, pid, P, M, 2 * I, H, BLOCK_M,
                  BLOCK_N, KC)
        _df_phase(BG, 2 * I, WD + layer * H * I, X, H, CNT, g + 3, 2 * I // BLOCK_N, pid, P, M, H, I, BLOCK_M,
                  BLOCK_N, KC)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--programs", default="33,66,132")
    ap.add_argument("--block-n", default="16,32")
    ap.add_argument("--tiles", default="64x2x4,128x2x4,128x3x4,64x3x8,128x3x8",
                    help="BLOCK_KxSTAGESxWARPS of the persistent GEMM phases")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dataflow", default="",
                    help="comma-separated PxBLOCK_NxKCxWARPS configs of the dataflow chain (no grid barrier: counters "
                         "per GEMM, each tile's weights in registers before it waits), e.g. 132x16x512x8,132x32x512x8")
    ap.add_argument("--variants", default="",
                    help="comma-separated, each also timed at every config (timing only): w_shared (no HBM weight "
                         "reads), x_fixed (inputs not written this launch), no_barrier; e.g. all three")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)
    out = {"device": torch.cuda.get_device_name(), "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "barrier_us": {}, "chain_us": {}}
    R = 240
    for P in (int(p) for p in args.programs.split(",")):
        if P > sms:
            continue

        def bar(P=P):
            cnt.zero_()
            _barrier_kernel[(P,)](cnt, R=R, num_warps=4)
        us = time_fn(bar, args.reps) * 1e3 / R
        out["barrier_us"][P] = us
        print(f"barrier: {P} programs, {us:.2f} us a barrier ({R} a launch)", flush=True)

    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s, k):
        return (torch.randn(*s, generator=g, device=dev) * k ** -0.5).to(dt)
    WQ, WO = rnd(LAYERS, QKV, HIDDEN, k=HIDDEN), rnd(LAYERS, HIDDEN, HIDDEN, k=HIDDEN)
    WG, WD = rnd(LAYERS, 2 * INTER, HIDDEN, k=HIDDEN), rnd(LAYERS, HIDDEN, INTER, k=INTER)
    x0 = torch.randn(ROWS, HIDDEN, generator=g, device=dev).to(dt)
    X = x0.clone()
    BQ = torch.empty(ROWS, QKV, device=dev, dtype=dt)
    BO = torch.empty(ROWS, HIDDEN, device=dev, dtype=dt)
    BG = torch.empty(ROWS, 2 * INTER, device=dev, dtype=dt)
    XC = torch.randn(ROWS, INTER, generator=g, device=dev).to(dt)

    def ref_chain(x):
        for layer in range(LAYERS):
            q = x @ WQ[layer].T
            o = q[:, :HIDDEN] @ WO[layer].T
            gu = o @ WG[layer].T
            x = gu[:, :INTER] @ WD[layer].T
        return x

    def cublas_chain():
        x = X
        for layer in range(LAYERS):
            torch.matmul(x, WQ[layer].T, out=BQ)
            torch.matmul(BQ[:, :HIDDEN], WO[layer].T, out=BO)
            torch.matmul(BO, WG[layer].T, out=BG)
            torch.matmul(BG[:, :INTER], WD[layer].T, out=X)
    X.copy_(x0)
    ref = ref_chain(x0).float()
    out["chain_us"]["cublas"] = time_fn(cublas_chain, args.reps) * 1e3
    print(f"chain of {4 * LAYERS} GEMMs, 49 rows, cuBLAS in one graph: {out['chain_us']['cublas']:.1f} us", flush=True)
    def checked(key, fn):
        """Run fn once against the torch chain, then time it if it is right: us (nan when wrong), or None when it
        does not run; recorded in `out` and printed."""
        try:
            X.copy_(x0)
            fn()
            torch.cuda.synchronize()
            err = ((X.float() - ref).abs().max() / ref.abs().max()).item()
            ok = err < 5e-2
            us = time_fn(fn, args.reps) * 1e3 if ok else float("nan")
        except Exception as e:
            print(f"  {key}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return None
        out["chain_us"][key] = us
        out.setdefault("chain_rel_err", {})[key] = err
        print(f"  {key}: {us:.1f} us (max error {err:.2e} of the largest output{'' if ok else ': WRONG'})", flush=True)
        return us

    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    for P, bn, (bk, stages, warps) in itertools.product((int(p) for p in args.programs.split(",")),
                                                         [int(b) for b in args.block_n.split(",")], tiles):
        if P > sms:
            continue

        def chain(P=P, bn=bn, bk=bk, stages=stages, warps=warps, **variant):
            cnt.zero_()
            _chain_kernel[(P,)](X, WQ, WO, WG, WD, BQ, BO, BG, cnt, XC, L=LAYERS, M=ROWS, H=HIDDEN, I=INTER,
                                NQ=QKV, BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                                **variant)
        key = f"P{P}_N{bn}_K{bk}_S{stages}_W{warps}"
        us = checked(key, chain)
        if us is None:
            continue
        for v in filter(None, args.variants.split(",")):
            flag = {"w_shared": "W_SHARED", "x_fixed": "X_FIXED", "no_barrier": "NO_BARRIER"}[v]
            vus = time_fn(lambda: chain(**{flag: True}), args.reps) * 1e3
            out["chain_us"][f"{key}_{v}"] = vus
            print(f"    {v}: {vus:.1f} us ({vus - us:+.1f} against the chain)", flush=True)
    cnts = torch.zeros(4 * LAYERS, dtype=torch.int32, device=dev)
    for cfg in filter(None, args.dataflow.split(",")):
        P, bn, kc, warps = (int(v) for v in cfg.split("x"))
        if P > sms:
            continue

        def df(P=P, bn=bn, kc=kc, warps=warps):
            cnts.zero_()
            _dataflow_kernel[(P,)](X, WQ, WO, WG, WD, BQ, BO, BG, cnts, L=LAYERS, M=ROWS, H=HIDDEN, I=INTER, NQ=QKV,
                                   BLOCK_M=64, BLOCK_N=bn, KC=kc, num_warps=warps, num_stages=1)
        checked(f"dataflow_P{P}_N{bn}_KC{kc}_W{warps}", df)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
