"""The `eyas` command line: generate, serve, bench, train-draft, and the make-* tools for drafts and their data."""
from __future__ import annotations

import argparse
import sys
import time


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2', an HF directory or a .gguf file")
    p.add_argument("--draft", default="auto",
                   help="EAGLE draft directory, 'default' (the draft shipped for smollm2), 'ngram' or "
                        "'ngram:N_MIN:N_MAX' (prompt lookup: no draft model, a chain of proposals from the text's own "
                        "earlier tokens), 'none', or 'auto' (default: the shipped draft when there is one)")
    p.add_argument("--speculation", default=None,
                   help="chain:K | tree:NAME (mc_sim_7b_63, 8, 16, smollm2_25|48d5|64|128) | tree JSON file | "
                        "dyn:kKdDnN (a dynamic tree, EAGLE-2: top-K beam, depth D, N tokens verified) | "
                        "dispatch:B1=SPEC,B2=SPEC,... (a tree per batch size; SPEC may be 'plain')")
    from eyas.spec.draft_quant import add_draft_quant_arg
    add_draft_quant_arg(p)
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter directory, merged into the model's weights at load")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto")


def _text_or_file(value: str | None, what: str) -> str | None:
    """A flag's value as given, or the contents of the file it names (a path that exists)."""
    if value is None:
        return None
    from pathlib import Path
    p = Path(value)
    try:
        return p.read_text() if p.is_file() else value
    except OSError as e:
        raise ValueError(f"could not read {what} from {value}: {e}") from None


def _guided(args):
    """`eyas generate`'s guided decoding flags -> GuidedDecoding (or None)."""
    import json

    from eyas import GuidedDecoding
    schema = _text_or_file(getattr(args, "json_schema", None), "--json-schema")
    if schema is not None:
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema is neither a file nor JSON: {e}") from None
    asked = {"json": schema, "regex": getattr(args, "regex", None), "choice": getattr(args, "choice", None),
             "grammar": _text_or_file(getattr(args, "grammar", None), "--grammar"),
             "json_object": getattr(args, "json_object", False)}
    if all(v in (None, False) for v in asked.values()):
        return None
    return GuidedDecoding(**asked)


def _sampling_params(args):
    from eyas import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
                          guided=_guided(args), repetition_penalty=args.repetition_penalty,
                          frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)


def _timings(n: int, t0: float, first: float | None, t1: float, spec: str = "") -> str:
    ttft = (first or t1) - t0
    decode = max(t1 - t0 - ttft, 1e-9)
    return (f"[{n} tokens | TTFT {ttft * 1000:.1f} ms | {n / (t1 - t0):.1f} tokens/s | "
            f"{decode * 1000 / max(n - 1, 1):.1f} ms/token{spec}]")


def _tp_generate(rank: int, world_size: int, device, args) -> None:
    """One rank of `eyas generate --tensor-parallel N`: shard the target, replicate the draft, step in lockstep
    (eyas.dist.TPEngine); rank 0 takes the prompt and prints."""
    from eyas.dist.tp import build_tp_engine
    from eyas.loader.resolve import resolve_draft_arg
    tp = build_tp_engine(args.model, resolve_draft_arg(args.model, args.draft), args.speculation, rank, world_size,
                         device, args.dtype, shard_draft=args.tp_draft == "sharded",
                         cuda_graphs="auto" if args.cuda_graphs else False)
    tok = tp.engine.tokenizer
    if rank != 0:
        tp.generate()
        return
    prompt = args.prompt
    if args.chat:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_bos=False)
    t0 = time.perf_counter()
    ids = tp.generate([prompt], _sampling_params(args))[0]
    t1 = time.perf_counter()
    print(tok.decode(ids) if tok is not None else ids, flush=True)
    print(f"\n{_timings(len(ids), t0, None, t1, f' | TP {world_size}')}", file=sys.stderr, flush=True)


def cmd_generate(args) -> int:
    from eyas import LLM
    from eyas.engine.detokenizer import TextStream
    from eyas.loader.resolve import resolve_draft_arg

    params = _sampling_params(args)  # bad settings fail before the model loads
    if args.tensor_parallel > 1:
        import torch
        from eyas.dist.launch import run_ranks
        from eyas.spec.draft_quant import asks_quant
        if asks_quant(args.draft_quant):
            raise SystemExit("eyas generate: --draft-quant does not combine with --tensor-parallel yet")
        if getattr(args, "lora", None):
            raise SystemExit("eyas generate: --lora does not combine with --tensor-parallel yet")
        cpu = args.device == "cpu" or not torch.cuda.is_available()
        run_ranks(_tp_generate, args.tensor_parallel, args, on_gpu=not cpu)
        return 0
    llm = LLM(args.model, device=args.device, dtype=args.dtype, draft=resolve_draft_arg(args.model, args.draft),
              speculation=args.speculation, draft_quant=args.draft_quant, lora=getattr(args, "lora", None),
              cuda_graphs="auto" if args.cuda_graphs else False)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                                        add_bos=False)
    engine = llm.engine
    t0 = time.perf_counter()
    seq = engine.add_request(prompt, params)
    stream = TextStream(params.stop or [])  # no incomplete character, nor a stop string's beginning, printed
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == seq.request_id:
                sys.stdout.write(stream.delta(out))
                sys.stdout.flush()
    spec = f" | TPC {seq.stats.tokens_per_call:.2f} ({engine.tree.name})" if llm.draft is not None else ""
    print(f"\n\n{_timings(seq.num_output, t0, seq.first_token_time, time.perf_counter(), spec)}", file=sys.stderr)
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
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this many times as likely as the likeliest (0: off)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already in the prompt or output by this (> 1 repeats less)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times each token's count in the output from its logit ([-2, 2])")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logits of tokens in the output ([-2, 2])")
    guide = g.add_argument_group("guided decoding (the output must match; at most one)").add_mutually_exclusive_group()
    guide.add_argument("--json-schema", help="a JSON schema, as JSON text or a file")
    guide.add_argument("--json-object", action="store_true", help="any JSON object")
    guide.add_argument("--regex", help="a regular expression the whole output matches")
    guide.add_argument("--choice", nargs="+", help="one of these strings exactly")
    guide.add_argument("--grammar", help="an EBNF grammar (xgrammar's dialect, start rule 'root'), text or a file")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode steps eagerly on a GPU (default: replay them from CUDA graphs)")
    g.add_argument("--tensor-parallel", type=int, default=1,
                   help="shard the target over N ranks (NCCL on GPUs, gloo on the CPU)")
    g.add_argument("--tp-draft", choices=["sharded", "replicated"], default="sharded",
                   help="with --tensor-parallel: the draft sharded like the target, or whole on every rank")
    g.set_defaults(func=cmd_generate)

    for module, attr in (("eyas.serve.api_server", "add_serve_parser"), ("eyas.serve.run_batch", "add_parser"),
                         ("eyas.train.trainer", "add_parser"),
                         ("eyas.train.distill_data", "add_parser"), ("eyas.train.self_instruct", "add_parser"),
                         ("eyas.train.context_prompts", "add_parser"), ("eyas.train.average", "add_parser"),
                         ("eyas.spec.tree_builder", "add_parser"),
                         ("eyas.spec.draft_vocab", "add_parser"),
                         ("eyas.bench.cli", "add_parser")):
        try:  # a subcommand whose optional dependencies are missing (the server's fastapi, say) is left out
            getattr(__import__(module, fromlist=[attr]), attr)(sub)
        except ImportError:
            continue
    return parser


def subcommand_main(add_parser, command: str, module: str, argv: list[str] | None = None) -> int:
    """`python -m MODULE ARGS` for a module that registers one eyas subcommand with `add_parser`: parses ARGS as
    `eyas COMMAND ARGS` does and runs it (errors propagate, for the module's own callers and tests)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"eyas: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
