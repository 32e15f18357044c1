"""Do cuBLAS's GEMM kernels wait for the kernel before them (griddepcontrol.wait), so that a captured graph's edge
into a cuBLAS node could be made programmatic (PDL) without a race? (session 32, point 2a)

The default tree's 49-row verify pass launches four cuBLAS GEMMs a layer as ordinary launches: only the Triton
launches after them overlap their start (PDL). PyTorch cannot launch cuBLAS with PDL, but a graph captured with
`keep_graph=True` can be edited before it is instantiated: an edge u -> v can be given the programmatic type. That is
only exact if v waits for u's writes (griddepcontrol.wait) before it reads them.

The race test: a Triton kernel lets its dependents launch at its first instruction, spins ~tens of us, then writes
X; a GEMM reads X. With the edge made programmatic, a consumer that does not wait reads the old X (the control: a
Triton copy without gdc_wait must fail, or the test proves nothing); one that waits reads the new X.
Then a synthetic 30-layer chain of the verify layer's GEMMs and small PDL kernels, timed with and without the edit.

    python tools/diag/cublas_pdl_probe.py [--race 0|1] [--chain 0|1] [--configs ...] [--json out.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_edges as ge  # noqa: E402
from l2_prefetch_bench import capture_graph, time_graph  # noqa: E402


@triton.jit
def _spin_write(src, dst, n, spins, BLOCK: tl.constexpr):
    tl.extra.cuda.gdc_launch_dependents()  # dependents may launch now: they must wait for this kernel's writes
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    t = tl.zeros([BLOCK], tl.float32) + 1.0
    for _ in range(spins):
        t = t * 1.0000001 + 1e-9
    x = x + tl.where(t < 0, 1.0, 0.0)  # t > 0 always; the compiler cannot know it
    tl.store(dst + offs, x.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr, WAIT: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def _scale_rows(x, n, BLOCK: tl.constexpr):
    """A small PDL kernel standing for RoPE/SwiGLU: x *= 1 in place (reads and writes every element)."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x + offs, tl.load(x + offs, mask=m) * 1.0, mask=m)


RACE_SHAPES = {  # the default tree's verify GEMMs at 49 rows (SmolLM2): (K, N, kind)
    "qkv": (576, 960, "linear"), "o": (576, 576, "addmm"), "gate_up": (576, 3072, "linear"),
    "down": (1536, 576, "addmm")}


def race(consumer: str, shape: str, spins: int, trials: int) -> dict:
    """Capture spin_write(S -> X) then consumer(X ...), make the spin kernel's out-edge programmatic, replay `trials`
    times with a new S each time (X zeroed before), and count the replays whose output is wrong. consumer: "copy"
    (a Triton copy without gdc_wait: the control, which should fail), "copy_wait" (with it), "gemm" (the shape's
    cuBLAS call reading X as its A operand), "addmm_c" (residual += A W^T with the residual as X)."""
    M = 49
    K, N, kind = RACE_SHAPES[shape]
    dev, dt = "cuda", torch.bfloat16
    A = torch.randn(M, K, device=dev, dtype=dt)
    W = torch.randn(N, K, device=dev, dtype=dt) / K ** 0.5
    if consumer == "addmm_c":
        S = torch.randn(M, N, device=dev, dtype=dt)  # the residual's new value, written by the spin kernel
    else:
        S = torch.randn(M, K, device=dev, dtype=dt)
    X = torch.zeros_like(S)
    R = torch.randn(M, N, device=dev, dtype=dt)
    Y = torch.empty(M, N, device=dev, dtype=dt) if consumer != "copy" and consumer != "copy_wait" \
        else torch.empty_like(S)
    n = S.numel()
    grid = (triton.cdiv(n, 1024),)

    def body():
        if consumer == "gemm" and kind == "addmm":
            Y.copy_(R)  # before the spin kernel: its edge stays ordinary
        _spin_write[grid](S, X, n, spins, BLOCK=1024)
        if consumer == "gemm":
            if kind == "linear":
                torch.nn.functional.linear(X, W, out=Y)
            else:
                Y.addmm_(X, W.t())
        elif consumer == "addmm_c":
            X.addmm_(A, W.t())
        else:
            _copy[grid](X, Y, n, BLOCK=1024, WAIT=consumer == "copy_wait")

    def ref():
        if consumer in ("copy", "copy_wait"):
            return S
        if consumer == "addmm_c":
            return S.float() + A.float() @ W.float().t()
        return (R.float() if kind == "addmm" else 0) + S.float() @ W.float().t()

    g = capture_graph(body, keep_graph=True)
    raw = g.raw_cuda_graph()
    nodes = ge.kernel_nodes(raw)
    changed = ge.make_programmatic(raw, lambda u, v: "_spin_write" in u.name)
    kinds = [(e.src.name[:60], e.dst.name[:60], e.type) for e in ge.edges(raw)]
    g.instantiate()
    wrong, worst = 0, 0.0
    for _ in range(trials):
        S.normal_()
        X.zero_()
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        out = X if consumer == "addmm_c" else Y
        err = (out.float() - ref()).abs().max().item()
        worst = max(worst, err)
        wrong += err > 0.1
    return {"consumer": consumer, "shape": shape, "nodes": [n.name[:120] for n in nodes], "edges": kinds,
            "edges_made_programmatic": changed, "trials": trials, "wrong": wrong, "worst_abs_err": worst}


def chain(layers: int, M: int, variant: str, reps: int, cfg=None) -> float:
    """ms a replay of a synthetic verify pass: per layer the qkv GEMM, a PDL small kernel (standing for RoPE + the
    store), o GEMM + residual, gate/up GEMM, a PDL small kernel (SwiGLU), down GEMM + residual (SmolLM2's shapes).
    variant: "cublas" (as the engine), "cublas_prog" (every edge into a cuBLAS node made programmatic: NOT exact,
    the race above shows cuBLAS does not wait; an upper bound), "tile" (decode_linear's tile kernel with PDL, `cfg`)."""
    from eyas.kernels.decode_linear import decode_linear
    H, F, QKV = 576, 1536, 960
    dev, dt = "cuda", torch.bfloat16
    Ws = [(torch.randn(QKV, H, device=dev, dtype=dt) * 0.02, torch.randn(H, H, device=dev, dtype=dt) * 0.02,
           torch.randn(2 * F, H, device=dev, dtype=dt) * 0.02, torch.randn(H, F, device=dev, dtype=dt) * 0.02)
          for _ in range(layers)]
    res = torch.randn(M, H, device=dev, dtype=dt)
    qkv = torch.empty(M, QKV, device=dev, dtype=dt)
    gu = torch.empty(M, 2 * F, device=dev, dtype=dt)

    def body():
        for wq, wo, wgu, wd in Ws:
            if variant == "tile":
                decode_linear(res, wq, out=qkv, pdl=True, config=cfg)
            else:
                torch.nn.functional.linear(res, wq, out=qkv)
            _scale_rows[(triton.cdiv(M * QKV, 1024),)](qkv, M * QKV, BLOCK=1024, launch_pdl=True)
            if variant == "tile":
                decode_linear(qkv[:, :H], wo, residual=res, out=res, pdl=True, config=cfg)
                decode_linear(res, wgu, out=gu, pdl=True, config=cfg)
            else:
                res.addmm_(qkv[:, :H], wo.t())
                torch.nn.functional.linear(res, wgu, out=gu)
            _scale_rows[(triton.cdiv(M * 2 * F, 1024),)](gu, M * 2 * F, BLOCK=1024, launch_pdl=True)
            if variant == "tile":
                decode_linear(gu[:, :F], wd, residual=res, out=res, pdl=True, config=cfg)
            else:
                res.addmm_(gu[:, :F], wd.t())

    g = capture_graph(body, keep_graph=True)
    if variant == "cublas_prog":
        ge.make_programmatic(g.raw_cuda_graph(), lambda u, v: ge.is_cublas(v))
    g.instantiate()
    return time_graph(g, reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--spins", type=int, default=20000)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--race", type=int, default=1)
    ap.add_argument("--chain", type=int, default=1)
    ap.add_argument("--configs", default="16x64x4x3,32x64x4x3,16x64x8x3,32x64x8x3,64x64x8x3,16x32x4x4,32x32x4x4,"
                    "16x128x4x2,32x128x8x2", help="tile configs BLOCK_NxBLOCK_KxWARPSxSTAGES")
    a = ap.parse_args()
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
           "device": torch.cuda.get_device_name(), "cuda_compiled": torch._C._cuda_getCompiledVersion()}
    drv = ctypes.c_int()
    ge.libcuda().cuDriverGetVersion(ctypes.byref(drv))
    out["driver"] = drv.value
    print(json.dumps(out), flush=True)
    out["race"] = []
    cases = [("copy", "qkv"), ("copy_wait", "qkv")] + [("gemm", k) for k in RACE_SHAPES] + \
        [("addmm_c", "o"), ("addmm_c", "down")]
    for c, shape in cases if a.race else []:
        try:
            r = race(c, shape, a.spins, a.trials)
        except Exception as e:  # noqa: BLE001
            r = {"consumer": c, "shape": shape, "error": repr(e)}
        print(json.dumps(r), flush=True)
        out["race"].append(r)
    out["chain"] = []
    from eyas.kernels.decode_linear import TileConfig
    cfgs = [None] + [TileConfig(*map(int, c.split("x"))) for c in a.configs.split(",") if c]
    for M in (49,) if a.chain else ():
        for rnd in range(2):
            for variant, cfg in [("cublas", None), ("cublas_prog", None)] + [("tile", c) for c in cfgs]:
                try:
                    ms = chain(30, M, variant, 200, cfg)
                except Exception as e:  # noqa: BLE001
                    ms = repr(e)[:300]
                row = {"rows": M, "variant": variant, "config": None if cfg is None else str(cfg), "ms": ms}
                print(json.dumps(row), flush=True)
                out["chain"].append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
