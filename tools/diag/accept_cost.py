"""A sampled step's acceptance: `accept_tree` (every node's rounds at once) against `accept_tree_reference` (the
walk, one round at a time), on the trees a step verifies, SmolLM2's 49,152-token vocabulary, random distributions.
On a GPU each call is captured in a CUDA graph and replayed, as a step runs it (`--eager`: launched); on the CPU it
is called. `accept_tree` runs with its uniforms in torch ops and, with `use_triton`, in one Triton launch (on the
CPU: interpreted, slow). All give the same path, count and bonus (checked here too).

    python tools/diag/accept_cost.py [--trees chain:0 chain:3 tree:8 tree:smollm2_48d5] [--batch 1 16]
        [--repeat 50] [--device cpu|cuda] [--eager]
"""
from __future__ import annotations

import argparse
import time

import torch

from eyas.spec.tree import Tree, resolve_tree
from eyas.spec.verifier import accept_tree, accept_tree_reference


def timed(fn, args, repeat: int, graph: bool) -> tuple[float, tuple]:
    """ms a call (a graph's replay on CUDA unless not `graph`), and the outputs."""
    cuda = args[0].is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = fn(*args)  # warm-up (and the eager result)
    call = lambda: fn(*args)  # noqa: E731
    if cuda and graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(*args)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(*args)
        call = g.replay
    call()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        call()
    sync()
    return (time.perf_counter() - t0) / repeat * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", default=["chain:0", "chain:3", "tree:8", "tree:smollm2_48d5"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--eager", action="store_true", help="on CUDA: launch each call instead of a graph's replay")
    args = ap.parse_args()
    dev = torch.device(args.device)
    how = "eager" if args.eager or dev.type != "cuda" else "CUDA graph"
    print(f"| tree | batch | the walk (accept_tree_reference), ms | every node at once (accept_tree), ms | ... and "
          f"the uniforms in Triton, ms | walk / Triton |  ({dev}, {how})")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.trees:
        tree = (Tree.chain(0) if name == "chain:0" else resolve_tree(name)).to(dev)
        for B in args.batch:
            g = torch.Generator(device=dev).manual_seed(B)
            N1 = tree.num_nodes + 1
            probs = torch.softmax(torch.randn(B, N1, args.vocab, device=dev, generator=g) * 3, -1)
            nodes = torch.randint(0, args.vocab, (B, N1), device=dev, generator=g)
            nodes = torch.where(torch.rand(B, N1, device=dev, generator=g) < 0.5, probs.argmax(-1).roll(1, 1), nodes)
            seeds, counters = torch.arange(B, device=dev), torch.full((B,), 100, device=dev)
            inputs = (probs, nodes, tree, seeds, counters)
            ms_ref, want = timed(accept_tree_reference, inputs, args.repeat, not args.eager)
            ms_new, got = timed(accept_tree, inputs, args.repeat, not args.eager)
            ms_tri, got_tri = timed(lambda *a: accept_tree(*a, use_triton=True), inputs, args.repeat, not args.eager)
            same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(want, got, got_tri))
            print(f"| {name} | {B} | {ms_ref:.3f} | {ms_new:.3f} | {ms_tri:.3f} | {ms_ref / ms_tri:.1f}x |"
                  + ("" if same else " OUTPUTS DIFFER |"))


if __name__ == "__main__":
    main()
