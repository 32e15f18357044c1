"""Does prefetching the next weight into L2 during the small kernels of a decode step pay? (GPU only; H200.)

    PYTHONPATH=. python3 tools/diag/l2_prefetch_bench.py --out /tmp/l2.json

A synthetic Llama-3.1-8B batch-1 forward: 32 layers of distinct bf16 weights (qkv, o, gate_up, down: 14 GB, so L2
holds none of them between forwards) run as F.linear at M = 1, and between consecutive GEMMs a "window" that stands
for the small kernels of the real step: a one-thread `torch.cuda._sleep` kernel of `--attn-us` before o_proj and
`--short-us` before the others (the session-6 profile: ~15 us of RoPE, attention and reduction, ~4 us for a norm or
SwiGLU, launch gaps included). Each variant is one forward captured in a CUDA graph and replayed; ms per forward:

* `gemm only`: no windows (what the weights cost at cuBLAS's bandwidth);
* `windows`: the windows, no prefetch (the real step's shape: GEMM time + window time);
* `prefetch S/A mode`: after each GEMM, a side stream prefetches the first S MB (A MB before o_proj) of the next
  weight (`l2_prefetch_triton` below: PTX `prefetch.global.L2` per 128-byte line, `line_last` with the evict_last
  priority, `bulk` sm_90's `cp.async.bulk.prefetch.L2` per 16 KiB, `load` real L2-only loads whose sum is dropped).

It also times two o_proj GEMMs (33.5 MB each, which the 50 MB L2 holds) back to back, on distinct weights and on
the same one: the second of the same reads its weight from L2, the most any prefetch could give.

Result on the H200 (session 10, docs/benchmarks.md): no variant saved time; the L2-resident o_proj GEMM took only
~2.6 us less than one reading HBM. This is a record of a measured dead end, not a fast path of eyas. (`load` with
an evict_last hint does not assemble: ptxas refuses `.evict_last` next to `.cg`, which the Triton interpreter
accepted.)

The saving of a variant is `windows - variant`; the most it can be is the windows' total.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MODES = ("line", "line_last", "bulk", "load")
LINE = 128  # bytes per L2 line
BULK_CHUNK = 16384  # bytes per bulk prefetch instruction
LOAD_CHUNK = 8192  # bytes per program of the load mode


@triton.jit
def _l2_load_kernel(P, nbytes, SINK, CHUNK: tl.constexpr):
    """`mode="load"`: real loads (16 bytes a thread at a time, cached in L2 only) whose sum goes nowhere."""
    offs = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(P + offs, mask=offs < nbytes, other=0, cache_modifier=".cg")
    total = tl.sum(v.to(tl.int32), axis=0)
    tl.store(SINK, total, mask=total == -1)  # never true (a sum of bytes), but the loads must not be optimised away


@triton.jit
def _l2_prefetch_kernel(P, nbytes, STEP: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr):
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * STEP
    inside = offs < nbytes
    ptrs = P + tl.where(inside, offs, 0)  # lanes past the end prefetch the first line again (harmless)
    if MODE == 0:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 1:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        size = tl.where(inside, tl.minimum(nbytes - offs, STEP), 16).to(tl.int32)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch_triton(t: torch.Tensor, nbytes: int, mode: str = "line") -> None:
    """Prefetch the first `nbytes` bytes of the contiguous CUDA tensor `t` (at most all of it) into L2."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch_triton needs a contiguous tensor")
    nbytes = min(int(nbytes), t.numel() * t.element_size())
    step = BULK_CHUNK if mode == "bulk" else LINE
    if mode == "bulk":
        nbytes -= nbytes % 16  # the bulk instruction's size is a multiple of 16 bytes
    if nbytes <= 0:
        return
    if mode == "load":
        sink = torch.empty(1, dtype=torch.int32, device=t.device)
        _l2_load_kernel[(triton.cdiv(nbytes, LOAD_CHUNK),)](t.view(-1).view(torch.uint8), nbytes, sink,
                                                             CHUNK=LOAD_CHUNK, num_warps=4)
        return
    lanes = triton.cdiv(nbytes, step)
    block = min(1024, triton.next_power_of_2(lanes))
    _l2_prefetch_kernel[(triton.cdiv(lanes, block),)](t.view(-1).view(torch.uint8), nbytes, STEP=step,
                                                      BLOCK=block, MODE=MODES.index(mode), num_warps=4)


SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
MB = 1 << 20


def sleep_cycles_per_us() -> float:
    """Clock cycles of torch.cuda._sleep per microsecond, measured on a graph of 100 sleeps."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(100):
            torch.cuda._sleep(20000)
    return 20000 / (time_graph(g) * 1e3 / 100)


def capture_graph(body, **graph_kwargs) -> torch.cuda.CUDAGraph:
    """`body` run once on a side stream (compiles, allocator warm-up), then captured into a graph
    (`graph_kwargs`: e.g. keep_graph=True, to edit it before `instantiate()`)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(**graph_kwargs)
    with torch.cuda.graph(g):
        body()
    return g


def time_graph(g: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """ms per replay."""
    for _ in range(3):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--attn-us", type=float, default=15.0)
    p.add_argument("--short-us", type=float, default=4.0)
    p.add_argument("--sizes", default="4/16,8/24,16/32,24/40,32/48", help="S/A pairs in MB")
    p.add_argument("--modes", default="line,load")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    weights = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _, n, k in SHAPES]
               for _ in range(args.layers)]
    x = {k: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for _, _, k in SHAPES}
    cyc = sleep_cycles_per_us()
    side = torch.cuda.Stream()

    def forward(windows: bool, s_mb: float = 0, a_mb: float = 0, mode: str = "line"):
        flat = [(w, name) for layer in weights for w, (name, _, _) in zip(layer, SHAPES)]
        main = torch.cuda.current_stream()
        for i, (w, name) in enumerate(flat):
            F.linear(x[w.shape[1]], w)
            if i + 1 == len(flat):
                break
            nxt, nname = flat[i + 1]
            if s_mb or a_mb:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    l2_prefetch_triton(nxt, int((a_mb if nname == "o" else s_mb) * MB), mode)
            if windows:
                torch.cuda._sleep(int(cyc * (args.attn_us if nname == "o" else args.short_us)))
        if s_mb or a_mb:
            main.wait_stream(side)

    def timed(*a) -> float:
        forward(*a)  # warm-up: compiles the prefetch kernel, cuBLAS picks its algorithms
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            forward(*a)
        return time_graph(g)

    # how fast a GEMM is when its weight was just read (o_proj: 33.5 MB, fits the 50 MB L2): the most a prefetch
    # can give
    w_o = [layer[1] for layer in weights]
    hot = {}
    for name, fn in (("o twice, distinct", lambda i: (F.linear(x[4096], w_o[i]), F.linear(x[4096], w_o[i + 1]))),
                     ("o twice, same", lambda i: (F.linear(x[4096], w_o[i]), F.linear(x[4096], w_o[i])))):
        g = torch.cuda.CUDAGraph()
        fn(0)
        with torch.cuda.graph(g):
            for i in range(0, args.layers - 1, 2):
                fn(i)
        hot[name] = time_graph(g) * 1e3 / (args.layers // 2)  # us per pair
    print(f"o_proj pair, us: {hot}")
    rows = {"gemm only": timed(False), "windows": timed(True)}
    nwin = 4 * args.layers - 1
    window_ms = (args.layers * args.attn_us + (nwin - args.layers) * args.short_us) / 1e3
    for mode in args.modes.split(","):
        for pair in args.sizes.split(","):
            s, a = (float(v) for v in pair.split("/"))
            rows[f"prefetch {pair} {mode}"] = timed(True, s, a, mode)
    gb = sum(w.numel() * 2 for layer in weights for w in layer) / 1e9
    print(f"{args.layers} layers, {gb:.2f} GB of weights; windows {args.attn_us}/{args.short_us} us "
          f"({window_ms:.3f} ms in all); sleep {cyc:.0f} cycles/us")
    print(f"{'variant':28s} {'ms':>8s} {'saved':>8s} {'TB/s':>6s}")
    for k, v in rows.items():
        print(f"{k:28s} {v:8.3f} {rows['windows'] - v:8.3f} {gb / v:6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "gb": gb, "o_pair_us": hot, "window_ms": window_ms, "ms": rows,
                       "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
