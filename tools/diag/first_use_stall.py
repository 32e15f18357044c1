"""What the first request of a kind that `eyas serve` does not capture ahead costs: steps that report log-probabilities
or apply penalties (`GraphedStep.launch_extras`) and guided steps (`launch_guided`) replay graphs captured when a key
is first met, in the request's path. On an engine set up as `eyas serve` sets it up (every sampling mode's decode
graphs and every prefill graph captured ahead), each row runs a wave of `--batch` MT-Bench first turns (greedy,
`--max-tokens` each, end-of-sequence ignored) in which the first request is of the kind (the others plain), twice
with the same prompts: the first wave meets the kind's graphs, the second replays them. "free" (no such request) is
the control. Reports each wave's wall time, its longest step (the stall a streaming client sees between two tokens)
and the graphs captured during it. As the server does, guided decoding's tokenizer view is made before the waves,
and a guided request's schema is compiled before its wave is timed (`compile_ms`; xgrammar caches it after).
`--shape smollm2-shape`: random weights of a shape and a random draft (`eyas.bench.shapes`, the shipped draft's
quantization and dispatcher as `capture_time.py` takes them), random prompts of MT-Bench's lengths; no tokenizer, so
no guided row.

    PYTHONPATH=. python3 tools/diag/first_use_stall.py --prompts question.jsonl [--batch-sizes 1,4] [--out s.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_rows import chat_prompts, emit, save  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "points": {"type": "array", "items": {
    "type": "string"}}}, "required": ["name", "points"]}
KINDS = ("free", "logprobs", "penalties", "guided")


def params(kind: str, max_tokens: int):
    from eyas import SamplingParams
    from eyas.sampling_params import GuidedDecoding
    extra = {"logprobs": {"logprobs": 5}, "penalties": {"repetition_penalty": 1.2, "frequency_penalty": 0.3},
             "guided": {"guided": GuidedDecoding(json=SCHEMA)}}.get(kind, {})
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def held(graphs) -> set:
    """The keys of every graph held (decode steps, their extras twins, guided steps)."""
    return set() if graphs is None else {*graphs.graphs, *graphs.extras, *graphs.guided}


def wave(engine, prompts: list[list[int]], kind: str, max_tokens: int) -> dict:
    graphs = engine.runner.graphs
    before = held(graphs)
    compile_ms = 0.0
    if kind == "guided":  # as the server does before queueing the request (`compile_guided`; xgrammar keeps it)
        c0 = time.perf_counter()
        engine.grammar_backend().compile(params(kind, max_tokens).guided)
        compile_ms = round((time.perf_counter() - c0) * 1e3, 1)
    _sync()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params(kind if i == 0 else "free", max_tokens))
    steps = []
    while engine.has_unfinished():
        s = time.perf_counter()
        engine.step()
        _sync()
        steps.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    new = held(graphs) - before
    return {"wall_ms": round(wall * 1e3, 1), "max_step_ms": round(max(steps) * 1e3, 2),
            "median_step_ms": round(sorted(steps)[len(steps) // 2] * 1e3, 3), "steps": len(steps),
            "graphs_captured": len(new), "compile_ms": compile_ms, "new_keys": sorted(map(str, new))}


def random_engine(shape: str, max_num_seqs: int, speculation: str | None, lengths: list[int]):
    """An engine over random weights of `shape` (`capture_time.random_engine`), and random prompts of `lengths`."""
    import capture_time
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine, _ = capture_time.random_engine(shape, device, speculation or capture_time.shipped_dispatch(device.type),
                                           max_num_seqs)
    g = torch.Generator().manual_seed(0)
    vocab = engine.target.config.vocab_size
    return engine, [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--shape", default=None, help="random weights of this shape instead of --model (no guided rows)")
    p.add_argument("--draft", default="default")
    p.add_argument("--speculation", default=None, help="default: the draft's own for the device")
    p.add_argument("--prompts", required=True, help="MT-Bench's question.jsonl")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16, help="the engine's (the server's default is 64)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from eyas import LLM
    from eyas.bench.tpc import read_prompts
    kinds = args.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"unknown kinds {bad}; choose among {KINDS}")
    if args.shape:
        if "guided" in kinds:
            kinds.remove("guided")
        records = read_prompts(args.prompts)
        engine, prompts = random_engine(args.shape, args.max_num_seqs, args.speculation,
                                        [len(r["text"]) // 4 + 40 for r in records])  # ~4 characters a token
    else:
        llm = LLM(args.model, device=args.device, draft=None if args.draft == "none" else args.draft,
                  speculation=args.speculation, max_num_seqs=args.max_num_seqs, cuda_graphs="auto")
        engine = llm.engine
        prompts = chat_prompts(llm.tokenizer, read_prompts(args.prompts))
    graphs, prefills = engine.runner.graphs, engine.runner.prefill_graphs
    t0 = time.perf_counter()
    n = graphs.capture_all(args.max_num_seqs) if graphs is not None else 0  # as `eyas serve`: every sampling mode
    if prefills is not None:
        n += prefills.capture_all(args.max_num_seqs, min(engine.config.max_num_batched_tokens, engine.max_model_len))
    _sync()
    capture_s = round(time.perf_counter() - t0, 1)
    if "guided" in kinds:  # the server makes guided decoding's tokenizer view at startup, beside the capture
        engine.grammar_backend()
    wave(engine, prompts[:1], "free", 4)  # the engine's own first request, untimed
    rows: list = []
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    at = 0
    for B in (int(x) for x in args.batch_sizes.split(",")):
        for kind in kinds:
            batch = prompts[at: at + B] or prompts[:B]
            at += B
            first, second = (wave(engine, batch, kind, args.max_tokens) for _ in range(2))
            emit(rows, {"device": device, "model": args.shape or args.model,
                        "speculation": getattr(engine.tree, "name", None), "batch": B, "kind": kind,
                        "max_tokens": args.max_tokens, "first": first, "second": second,
                        "stall_ms": round(first["wall_ms"] - second["wall_ms"], 1)})
    save(args.out, args, rows, graphs_ahead=n, capture_s=capture_s)


if __name__ == "__main__":
    main()
