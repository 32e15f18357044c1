"""`eyas bench peers`: HF transformers on the same prompts and token counts (batch 1, greedy): eager with its
dynamic cache, the static cache, and prompt-lookup decoding. The HF model is built from the weights eyas loaded, so
both run the same numbers."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def hf_from_eyas(target):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**{k: v for k, v in target.config.to_hf().items()
                         if k not in ("architectures", "model_type", "bias")})
    p = next(target.parameters())
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)
    hf.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("rope.")},
                       strict=False, assign=True)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    with torch.device(p.device):  # buffers are not in the state dict: build them for real
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)
    eos = list(target.config.eos_token_ids)
    hf.generation_config.eos_token_id = eos or None  # generate() fails on an empty list
    hf.generation_config.pad_token_id = eos[0] if eos else 0
    return hf.to(p.device, p.dtype).eval()


def time_generate(hf, prompts, max_tokens, **kw) -> dict:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    dev = next(hf.parameters()).device
    hf.generate(torch.tensor([prompts[0]], device=dev), max_new_tokens=4, min_new_tokens=4, do_sample=False, **kw)
    total_t, total_n = 0.0, 0
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, **kw)
        sync()
        total_t += time.perf_counter() - t0
        total_n += out.shape[1] - ids.shape[1]
    return {"ms_per_token": total_t * 1000 / total_n, "tokens": total_n}


PEERS = {"hf-eager": {}, "hf-static-cache": {"cache_implementation": "static"},
         "hf-prompt-lookup": {"prompt_lookup_num_tokens": 10}}


def run(args) -> int:
    from eyas.bench.latency import make_prompts
    from eyas.loader import load_target
    target, tok = load_target(args.model, args.device, args.dtype)
    prompts = make_prompts(tok, target.config.vocab_size, args.num_prompts, 256, args.prompts)
    hf = hf_from_eyas(target)
    rows = {}
    wanted = [x.strip() for x in args.peers.split(",") if x.strip()]
    unknown = sorted(set(wanted) - set(PEERS))
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    for name in wanted:
        kw = PEERS[name]
        try:
            rows[name] = time_generate(hf, prompts, args.max_tokens, **kw)
        except Exception as e:  # a peer that fails is reported, not fatal
            rows[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, rows[name], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens,
                                                "prompts": len(prompts), "results": rows}, indent=2))
    return 0


def add_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser("peers", help="HF transformers peers on the same prompts (batch 1, greedy)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", default=None)
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of " + ", ".join(PEERS))
    p.add_argument("--out", default="bench-out/peers")
    p.set_defaults(func=run)
    return p
