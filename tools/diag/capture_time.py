"""How long `eyas serve` spends at startup capturing its CUDA graphs (`GraphedStep.capture_all`, which the server
runs before its first request, then the prefills' `PrefillGraphs.capture_all`), with the context buckets as shipped
(`eyas.engine.cuda_graph.CONTEXT_BUCKETS`) or without them (`--buckets none`: one graph per batch bucket, greedy flag
and tree, for the whole context).

The model is a random-weight shape (`smollm2-shape` by default: SmolLM2's sizes and the shipped draft's
quantization), its random draft, and the shipped SmolLM2 draft's dispatcher for CUDA; the engine has the server's
defaults (64 sequences, the shape's 8192-token context). Run one process per variant: the first process of a
machine also compiles the kernels, so alternate the order. Prints one JSON line.

    PYTHONPATH=. python3 tools/diag/capture_time.py [--buckets default|none] [--max-num-seqs 64] \\
        [--capture-extras logprobs ...]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import eyas.engine.cuda_graph as cg
from eyas.bench.shapes import SHAPES, random_draft, random_target
from eyas.engine.engine import EngineConfig, LLMEngine
from eyas.loader.resolve import DRAFTS_DIR
from eyas.spec.draft_quant import apply_draft_quant
from eyas.spec.tree import resolve_tree


def shipped_dispatch(device_type: str) -> str:
    cfg = json.loads((DRAFTS_DIR / "smollm2" / "config.json").read_text())
    return cfg["eyas_speculation"][device_type]


def random_engine(shape: str, device: torch.device, speculation: str, max_num_seqs: int,
                  max_model_len: int | None = None):
    """An engine over random weights of `shape` and a random draft quantized as the shipped draft is (graphs on
    CUDA), with the server's other defaults; returns it and the draft's quantization."""
    target = random_target(shape, device)
    draft = random_draft(target, config=SHAPES[shape])
    quant = getattr(apply_draft_quant(draft, target, None), "quant", None)
    engine = LLMEngine(target, None, draft, resolve_tree(speculation),
                       EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                    cuda_graphs=device.type == "cuda"))
    return engine, quant


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-shape", choices=sorted(SHAPES))
    p.add_argument("--buckets", default="default", choices=("default", "none"))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the shape's context")
    p.add_argument("--speculation", default=None, help="default: the shipped SmolLM2 draft's for the device type")
    p.add_argument("--device", default="cuda")
    p.add_argument("--capture-extras", nargs="+", default=[], choices=sorted(cg.EXTRAS_KINDS),
                   help="as `eyas serve --capture-extras`")
    args = p.parse_args()
    if args.buckets == "none":
        cg.CONTEXT_BUCKETS = ()
    device = torch.device(args.device)
    t0 = time.perf_counter()
    spec = args.speculation or shipped_dispatch(device.type)
    engine, quant = random_engine(args.shape, device, spec, args.max_num_seqs, args.max_model_len)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    graphs = engine.runner.graphs
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    extras = tuple(cg.EXTRAS_KINDS[e] for e in args.capture_extras)
    n = graphs.capture_all(args.max_num_seqs, extras=extras) if graphs is not None else 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    # the prefills' graphs (`eyas.engine.prefill_graph`), as `eyas serve` captures them after the steps'
    prefills, n_pre = engine.runner.prefill_graphs, 0
    mid = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    if prefills is not None:
        n_pre = prefills.capture_all(args.max_num_seqs, min(engine.config.max_num_batched_tokens, engine.max_model_len))
        torch.cuda.synchronize()
    t3 = time.perf_counter()
    print(json.dumps({
        "shape": args.shape, "buckets": args.buckets, "capture_extras": args.capture_extras,
        "context_buckets": list(graphs.context_buckets) if graphs else [],
        "max_num_seqs": args.max_num_seqs, "max_model_len": engine.max_model_len, "speculation": spec,
        "draft_quant": quant, "build_s": round(t1 - t0, 2), "graphs": n, "capture_s": round(t2 - t1, 2),
        "capture_mib": round((mid - before) / 2**20), "prefill_graphs": n_pre, "prefill_capture_s": round(t3 - t2, 2),
        "prefill_capture_mib": round(((torch.cuda.memory_reserved(device) if device.type == "cuda" else 0) - mid)
                                     / 2**20),
    }))


if __name__ == "__main__":
    main()
