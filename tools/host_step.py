"""Host cost of a decode step (CPU): the engine's step() with the model forward stubbed out.

The speculative step itself (`spec_step`, a CUDA graph replay on the GPU) is replaced by a stub that returns outputs
of the right shapes, so what is timed is what the host does around it: scheduling, packing the inputs, the copy into
the graph's static buffers, applying the outputs, detokenisation and stop checks.

    PYTHONPATH=. python tools/host_step.py --batches 1 8 64 256 --steps 50 [--profile 64] [--warm-steps N]

`--warm-steps N` steps first, untimed: the outputs are ~N x (tokens a step) long when timing starts, for what the
host's step costs on long generations.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time

import torch

import eyas.engine.runner as runner_mod
from eyas.config import ModelConfig
from eyas.engine.engine import EngineConfig, LLMEngine
from eyas.models.eagle import EagleDraft
from eyas.models.llama import LlamaForCausalLM
from eyas.sampling_params import SamplingParams
from eyas.spec import step as step_mod
from eyas.spec.tree import resolve_tree


def tiny_models(vocab: int):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    draft = EagleDraft(dataclasses.replace(cfg, num_hidden_layers=1)).eval().requires_grad_(False)
    return target, draft


def make_stub(tree, vocab: int, hidden: int, graph_copy: bool):
    g = torch.Generator().manual_seed(0)
    static = {}

    def stub(*args, **kwargs):
        inp = next(a for a in list(args) + list(kwargs.values()) if isinstance(a, step_mod.DecodeInputs))
        B = inp.root_tokens.shape[0]
        if graph_copy and hasattr(inp, "fill_from"):  # what a graph replay adds: the copy into static buffers
            if B not in static:
                static[B] = dataclasses.replace(inp, **{
                    f.name: torch.zeros((B, *getattr(inp, f.name).shape[1:]) if f.name != "block_tables" else
                                        (B, 64), dtype=getattr(inp, f.name).dtype)
                    for f in dataclasses.fields(inp) if isinstance(getattr(inp, f.name), torch.Tensor)})
            static[B].fill_from(inp)
        D1 = tree.max_depth + 1
        vals = dict(path_tokens=torch.randint(0, vocab, (B, D1), generator=g),
                    num_accepted=torch.randint(0, D1, (B,), generator=g),
                    bonus=torch.randint(0, vocab, (B,), generator=g),
                    accepted_hidden=torch.zeros(B, D1, hidden) if tree.num_nodes else None)
        vals["packed"] = torch.cat([vals["num_accepted"][:, None], vals["path_tokens"], vals["bonus"][:, None]], 1)
        names = [f.name for f in dataclasses.fields(step_mod.DecodeOutputs)]
        return step_mod.DecodeOutputs(**{k: vals[k] for k in names if k in vals})

    return stub


def run(batch: int, steps: int, spec: str | None, tokenizer, profile: bool, warm: int = 3):
    vocab = tokenizer.vocab_size if tokenizer is not None else 1000
    target, draft = tiny_models(vocab)
    tree = resolve_tree(spec) if spec else None
    prompt_len, max_tokens = 64, 1 << 20
    max_len = max(4096, prompt_len + ((tree.max_depth if tree else 0) + 1) * (warm + steps) + 64)
    cfg = EngineConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=4096, block_size=16,
                       num_blocks=batch * (max_len // 16 + 2) + 8, max_model_len=max_len)
    engine = LLMEngine(target, tokenizer, draft if tree else None, tree, cfg)
    runner_mod.spec_step = make_stub(engine.tree, vocab, 64, graph_copy=True)
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, top_p=0.9, max_tokens=max_tokens, ignore_eos=True,
                             seed=i, stop=["zzzz"] if i % 4 == 0 else None) for i in range(batch)]
    for i in range(batch):
        engine.add_request(torch.randint(10, vocab, (prompt_len,), generator=g).tolist(), params[i])
    while engine.step_counts["decode"] == 0:  # prefill everything (real forwards)
        engine.step()
    for _ in range(warm):
        engine.step()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(steps):
        engine.step()
    if prof:
        prof.disable()
    dt = (time.perf_counter() - t0) / steps
    return dt, prof


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--spec", default="tree:mc_sim_7b_63", help="'none' for plain decoding")
    ap.add_argument("--no-tokenizer", action="store_true")
    ap.add_argument("--profile", type=int, nargs="*", default=[], help="batch sizes to cProfile")
    ap.add_argument("--warm-steps", type=int, default=3, help="untimed steps first (longer outputs when timed)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = None
    if not args.no_tokenizer:
        from eyas.loader.gguf import load_gguf_tokenizer
        from eyas.loader.resolve import smollm2_path
        tok = load_gguf_tokenizer(smollm2_path())
    spec = None if args.spec == "none" else args.spec
    for b in args.batches:
        dt, _ = run(b, args.steps, spec, tok, False, args.warm_steps)
        print(f"spec={args.spec} batch={b:4d} warm={args.warm_steps}: host {dt * 1e3:8.3f} ms/step  {dt * 1e6 / b:8.1f} us/seq/step",
              flush=True)
        if b in args.profile:
            _, prof = run(b, args.steps, spec, tok, True, args.warm_steps)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
