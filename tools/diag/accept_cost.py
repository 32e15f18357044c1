"""A sampled step's acceptance from bf16 logits at temperature 1: the walk on the softmax (`accept_tree_reference`,
one round at a time), every node's rounds at once on the softmax (`accept_tree`), and `accept_tree_logits` (no
probabilities: one pass of row statistics and a race for the bonus) in torch ops and on its Triton passes, with greedy
acceptance for scale; on the trees a step verifies, SmolLM2's 49,152-token vocabulary, random logits. On a GPU each
call is captured in a CUDA graph and replayed, as a step runs it (`--eager`: launched); on the CPU it is called
(Triton interpreted, slow). The walk and `accept_tree` give the same outputs, and so do the two `accept_tree_logits`
(checked here too; the two families draw their bonus differently).

    python tools/diag/accept_cost.py [--trees chain:0 chain:3 tree:8 tree:smollm2_48d5] [--batch 1 16]
        [--repeat 50] [--device cpu|cuda] [--eager] [--no-walk]
"""
from __future__ import annotations

import argparse
import time

import torch

from eyas.spec.tree import Tree, resolve_tree
from eyas.layers.sampler import logits_to_probs
from eyas.spec.verifier import accept_tree, accept_tree_greedy, accept_tree_logits, accept_tree_reference


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
    ap.add_argument("--no-walk", action="store_true", help="skip the walk (slow on deep trees)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    how = "eager" if args.eager or dev.type != "cuda" else "CUDA graph"
    print(f"From bf16 logits at temperature 1, ms a call ({dev}, {how}): the walk on the softmax "
          "(accept_tree_reference); every node at once on the softmax (accept_tree, uniforms in Triton); from the "
          "logits (accept_tree_logits) in torch ops, with the Triton passes, and with the rounds fused too; greedy "
          "acceptance (argmax + accept_tree_greedy_triton) for scale.")
    print("| tree | batch | walk | accept_tree | logits, torch | logits, Triton | logits, fused rounds | greedy "
          "| same |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.trees:
        tree = (Tree.chain(0) if name == "chain:0" else resolve_tree(name)).to(dev)
        for B in args.batch:
            g = torch.Generator(device=dev).manual_seed(B)
            N1 = tree.num_nodes + 1
            logits = (torch.randn(B, N1, args.vocab, device=dev, generator=g) * 3).bfloat16()
            nodes = torch.randint(0, args.vocab, (B, N1), device=dev, generator=g)
            top = logits.argmax(-1)
            nodes = torch.where(torch.rand(B, N1, device=dev, generator=g) < 0.5, top.roll(1, 1), nodes)
            seeds, counters = torch.arange(B, device=dev), torch.full((B,), 100, device=dev)
            temp = torch.ones(B, device=dev)
            flat = B * N1

            def probs_of(lg):
                return logits_to_probs(lg.view(flat, -1), temp.repeat_interleave(N1), torch.zeros(
                    flat, dtype=torch.long, device=dev), torch.ones(flat, device=dev), filters=False).view(B, N1, -1)

            def walk(lg):
                return accept_tree_reference(probs_of(lg), nodes, tree, seeds, counters)

            def rounds(lg):
                return accept_tree(probs_of(lg), nodes, tree, seeds, counters, use_triton=dev.type == "cuda")

            def from_logits(lg, triton=False):
                return accept_tree_logits(lg, temp, nodes, tree, seeds, counters, use_triton=triton)

            def fused(lg):  # the rounds and walk in one launch too (`eyas.kernels.accept_sampled`)
                from eyas.kernels.accept_sampled import accept_tree_logits_triton
                return accept_tree_logits_triton(lg, temp, nodes, tree, seeds, counters)[:3]

            def greedy(lg):
                if dev.type != "cuda":
                    return accept_tree_greedy(lg.argmax(-1), nodes, tree)
                from eyas.kernels.accept_greedy import accept_tree_greedy_triton
                from eyas.layers.topk import argmax
                return accept_tree_greedy_triton(argmax(lg), nodes, tree)[:3]

            ms = {}
            outs = {}
            for key, fn in (("walk", walk), ("rounds", rounds), ("logits", from_logits),
                            ("logits_triton", lambda lg: from_logits(lg, dev.type == "cuda")),
                            ("fused", fused), ("greedy", greedy)):
                if key == "fused" and dev.type != "cuda":  # interpreted: slow, and timed nothing
                    continue
                if key == "walk" and args.no_walk:
                    continue
                ms[key], outs[key] = timed(fn, (logits,), args.repeat, not args.eager)
            same_probs = "walk" not in outs or all(torch.equal(a, b) for a, b in zip(outs["walk"], outs["rounds"]))
            same_logits = all(torch.equal(a, b) for a, b in zip(outs["logits"], outs["logits_triton"]))
            if "fused" in outs:
                same_logits &= all(torch.equal(a, b) for a, b in zip(outs["logits"], outs["fused"]))
            cell = lambda k: f"{ms[k]:.3f}" if k in ms else "-"  # noqa: E731
            print(f"| {name} | {B} | {cell('walk')} | {cell('rounds')} | {cell('logits')} | {cell('logits_triton')} "
                  f"| {cell('fused')} | {cell('greedy')} | {'yes' if same_probs and same_logits else 'NO'} |")


if __name__ == "__main__":
    main()
