"""Is a prefill graph's first replay slower than its later ones? TTFT of one request at each of several prompt
lengths (each its own padded shape), twice over with other tokens, on an engine whose prefill graphs were all
captured ahead (`PrefillGraphs.capture_all`), random weights of a shape (no prefix caching, so nothing is a hit).
`--variants off,on,off`: one engine after another in this process, each with `eyas.engine.prefill_graph.WARM_REPLAY`
(each graph replayed once right after its capture) off or on. GPU only. Prints one JSON line a variant.

    PYTHONPATH=. python3 tools/diag/first_replay.py [--variants off,on,off] [--out /tmp/first.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import eyas.engine.prefill_graph as pg
from eyas.bench.shapes import SHAPES, random_draft, random_target
from eyas.engine.engine import EngineConfig, LLMEngine
from eyas.sampling_params import SamplingParams
from eyas.spec.tree import resolve_tree


def ttft_ms(engine, prompt: list[int]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    seq = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while seq.num_output == 0:
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    while engine.has_unfinished():
        engine.step()
    return ms


def variant(args, target, draft, warm: bool) -> dict:
    pg.WARM_REPLAY = warm
    lengths = [int(x) for x in args.lengths.split(",")]
    engine = LLMEngine(target, None, draft, resolve_tree(args.speculation),
                       EngineConfig(max_num_seqs=1, max_model_len=1024, cuda_graphs=True, prefix_caching=False))
    engine.runner.graphs.capture_all(1, modes=("greedy",))
    t0 = time.perf_counter()
    n = engine.runner.prefill_graphs.capture_all(1, max(lengths))
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    ttft_ms(engine, torch.randint(10, vocab, (10,), generator=g).tolist())  # the engine's own first request
    rows = {L: [] for L in lengths}
    for _ in range(args.rounds):
        for L in lengths:
            rows[L].append(round(ttft_ms(engine, torch.randint(10, vocab, (L,), generator=g).tolist()), 3))
    return {"shape": args.shape, "device": torch.cuda.get_device_name(), "warm_replay": warm,
            "prefill_graphs": n, "capture_s": round(capture_s, 2), "ttft_ms_by_round": rows,
            "first_mean": round(sum(r[0] for r in rows.values()) / len(rows), 3),
            "later_mean": round(sum(sum(r[1:]) / (len(r) - 1) for r in rows.values()) / len(rows), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-shape", choices=sorted(SHAPES))
    p.add_argument("--speculation", default="tree:smollm2_48d5")
    p.add_argument("--lengths", default="20,40,70,100,150,200,300,450")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="off,on,off")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = random_target(args.shape, torch.device("cuda"))
    draft = random_draft(target, config=SHAPES[args.shape])
    outs = []
    for v in args.variants.split(","):
        outs.append(variant(args, target, draft, v == "on"))
        print(json.dumps(outs[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(outs, f, indent=1)


if __name__ == "__main__":
    main()
