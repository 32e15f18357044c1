"""Graphed plain-decode throughput of the engine at batch 128 and 256, random SmolLM2-shape weights (what
`eyas make-distill-data` could reach): PYTHONPATH=. python3 tools/diag/decode_throughput.py
Used on the H200 on 2026-11-29 (docs/draft-training.md, "Regenerated data"): 29,299 tokens/s at batch 256."""
import time, torch
from eyas.bench.shapes import random_target
from eyas.engine.engine import EngineConfig, LLMEngine
from eyas.sampling_params import SamplingParams
dev = torch.device("cuda")
tgt = random_target("smollm2-shape", dev, torch.bfloat16)
for bs in (128, 256):
    eng = LLMEngine(tgt, None, None, None, EngineConfig(max_num_seqs=bs, cuda_graphs=True, max_num_batched_tokens=8192))
    eng.eos_ids = set()
    g = torch.Generator().manual_seed(0)
    n = bs * 2
    for i in range(n):
        eng.add_request(torch.randint(0, 49152, (200,), generator=g).tolist(), SamplingParams(temperature=0.0, max_tokens=256))
    t0 = time.perf_counter(); toks = 0; steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            pass
        steps += 1
    dt = time.perf_counter() - t0
    print(f"batch {bs}: {n} requests x 256 tokens in {dt:.1f} s -> {n*256/dt:,.0f} tok/s, {steps} steps, {dt/steps*1000:.2f} ms/step")
    del eng; torch.cuda.empty_cache()
