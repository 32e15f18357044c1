"""The `eyas` command line: generate, serve, bench, train-draft, make-distill-data."""
from __future__ import annotations

import argparse
import sys
import time


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2', an HF directory or a .gguf file")
    p.add_argument("--draft", default="auto",
                   help="EAGLE draft directory, 'default' (the draft shipped for smollm2), 'none', or 'auto' "
                        "(default: the shipped draft when there is one)")
    p.add_argument("--speculation", default=None, help="chain:K | tree:NAME (mc_sim_7b_63, 8, 16) | tree JSON file")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto")


def cmd_generate(args) -> int:
    from eyas import LLM, SamplingParams
    from eyas.loader.resolve import resolve_draft_arg

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)  # fail fast
    llm = LLM(args.model, device=args.device, dtype=args.dtype, draft=resolve_draft_arg(args.model, args.draft),
              speculation=args.speculation)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    engine = llm.engine
    t0 = time.perf_counter()
    seq = engine.add_request(prompt, params)
    printed = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == seq.request_id:
                sys.stdout.write(out.text[printed:])
                sys.stdout.flush()
                printed = len(out.text)
    total = time.perf_counter() - t0
    n = seq.num_output
    ttft = (seq.first_token_time or t0) - t0
    decode_time = max(total - ttft, 1e-9)
    spec = ""
    if llm.draft is not None:
        spec = f" | TPC {seq.stats.tokens_per_call:.2f} ({engine.tree.name})"
    print(f"\n\n[{n} tokens | TTFT {ttft * 1000:.1f} ms | {n / total:.1f} tokens/s | "
          f"{decode_time * 1000 / max(n - 1, 1):.1f} ms/token{spec}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eyas", description="EAGLE tree speculative decoding for Llama models")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from one prompt, streaming to the terminal")
    _add_model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    for module, attr in (("eyas.serve.api_server", "add_serve_parser"), ("eyas.train.trainer", "add_parser"),
                         ("eyas.train.distill_data", "add_parser"), ("eyas.bench.cli", "add_parser")):
        try:
            mod = __import__(module, fromlist=[attr])
        except ImportError:
            continue
        getattr(mod, attr)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"eyas: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
