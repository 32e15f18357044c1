"""`eyas bench tpc`: draft quality as tokens per target call (TPC) and acceptance by depth.

For every (draft, speculation, temperature) it generates from the first turns of a prompt file (MT-Bench's
question.jsonl by default, wrapped in the model's chat template) with `max_tokens` new tokens each, and reports

* TPC: committed tokens / target (verify) calls, summed over all prompts (the prefill's first token is not counted);
  also the mean of the per-prompt TPCs;
* acceptance by depth: the share of speculative steps whose accepted path reached depth d (d = 1..tree depth);
* the same by prompt category, where the prompt file has one (MT-Bench's `category`: writing, roleplay, ...).

A prompt record may carry a guide (`json_schema`, `regex`, `choice`, `grammar`, or `"json_object": true`): its
output is then guided (`eyas.spec.grammar`), and each result counts `guided` prompts and, of the guided outputs
that ended, how many match their guide (`guided_valid`: JSON that parses, a full regex match, a choice).
`--no-guided` runs the same prompts without their guides, for comparison (docs/bench/json_tasks.jsonl: tasks with
a JSON schema each).

It writes `tpc.json`, `tpc.md` (markdown tables: the results, then TPC by category) and `acceptance.png`
(acceptance by depth, one panel per temperature) into --out. It runs on the CPU or the GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = "../shared/data/mt_bench/question.jsonl"


def read_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """Records with a first user turn (`text`) and every user turn (`turns`): MT-Bench (`turns`), conversations,
    or {"prompt": ...}."""
    from eyas.train.data import normalize_messages, read_jsonl

    path = Path(path)
    if not path.exists():
        raise ValueError(f"prompt file {path} does not exist")
    out = []
    for rec in read_jsonl(path):
        if "turns" in rec and rec["turns"]:
            users = list(rec["turns"])
        elif "prompt" in rec:
            users = [rec["prompt"]]
        else:
            msgs = normalize_messages(rec, need_assistant=False) or []
            users = [m["content"] for m in msgs if m["role"] == "user"]
            if not users:
                continue
        out.append({"id": rec.get("question_id", rec.get("id", len(out))), "category": rec.get("category"),
                    "text": users[0], "turns": users, "guided": guide_of(rec, path)})
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no prompts found")
    return out


GUIDE_KEYS = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
              "json_object": "json_object"}


def guide_of(rec: dict, path) -> "GuidedDecoding | None":
    """A prompt record's guide, or None (ValueError naming the file for a bad one)."""
    from eyas.sampling_params import GuidedDecoding
    asked = {GUIDE_KEYS[k]: rec[k] for k in GUIDE_KEYS if rec.get(k) not in (None, False)}
    if not asked:
        return None
    try:
        return GuidedDecoding(**asked)
    except ValueError as e:
        raise ValueError(f"{path}: record {rec.get('question_id', rec.get('id', '?'))}: {e}") from None


def matches_guide(g, text: str) -> bool:
    """Whether a finished output matches its guide (JSON that parses to an object with the schema's required
    keys; a full match of the regex, in Python's dialect; one of the choices). Grammars are not checked: True."""
    import re
    if g.regex is not None:
        return re.fullmatch(g.regex, text) is not None
    if g.choice is not None:
        return text in g.choice
    if g.json is not None or g.json_object:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return False
        schema = g.json if isinstance(g.json, dict) else json.loads(g.json) if g.json else {}
        return isinstance(obj, dict) and all(k in obj for k in schema.get("required", []))
    return True


def summarize(stats: list, depth: int) -> dict:
    """TPC (summed and per-prompt mean) and acceptance by depth of some requests' `SpecStats`."""
    calls = sum(s.target_calls for s in stats)
    committed = sum(s.committed for s in stats)
    acc = [0] * depth
    for s in stats:
        for d, n in enumerate(s.accepted_by_depth[:depth]):
            acc[d] += n
    per_prompt = [s.tokens_per_call for s in stats if s.target_calls]
    return {"tpc": committed / max(calls, 1), "tpc_mean_per_prompt": sum(per_prompt) / max(len(per_prompt), 1),
            "target_calls": calls, "committed": committed, "acceptance_by_depth": [a / max(calls, 1) for a in acc]}


def run_one(target, tokenizer, draft, speculation: str, prompts: list[list[int]], temperature: float,
            max_tokens: int, batch_size: int, seed: int, kv_cache_bytes: int | None = None,
            categories: list | None = None, guides: list | None = None) -> dict:
    """`categories` (one per prompt, None where a prompt has none): the result also holds `by_category`, the same
    summary for each category's prompts, in order of first appearance. `guides` (one per prompt, None where a
    prompt has none): guided decoding for those prompts."""
    from eyas.engine.engine import EngineConfig, LLMEngine
    from eyas.sampling_params import SamplingParams
    from eyas.spec.tree import resolve_tree

    tree = resolve_tree(speculation)
    engine = LLMEngine(target, tokenizer, draft, tree,
                       EngineConfig(max_num_seqs=batch_size, kv_cache_bytes=kv_cache_bytes))
    depth = engine.tree.max_depth
    guides = guides or [None] * len(prompts)
    stats, valid, ended = [], 0, 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start: start + batch_size]
        seqs = [engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                     seed=seed + start + i, guided=guides[start + i]))
                for i, p in enumerate(chunk)]
        while engine.has_unfinished():
            engine.step()
        stats += [s.stats for s in seqs]
        for s in seqs:
            if s.params.guided is not None and s.finish_reason == "stop":
                ended += 1
                valid += matches_guide(s.params.guided, s.text)
    wall = time.perf_counter() - t0
    del engine
    out = {"speculation": speculation, "temperature": temperature, "prompts": len(prompts), "max_tokens": max_tokens,
           **summarize(stats, depth), "tree_nodes": engine_nodes(tree), "depth": depth, "wall_seconds": round(wall, 2)}
    if any(g is not None for g in guides):
        out.update(guided=sum(g is not None for g in guides), guided_ended=ended, guided_valid=valid)
    if categories is not None and any(c is not None for c in categories):
        if len(categories) != len(prompts):
            raise ValueError(f"{len(categories)} categories for {len(prompts)} prompts")
        labels = ["(none)" if c is None else str(c) for c in categories]
        out["by_category"] = {c: {"prompts": labels.count(c),
                                  **summarize([s for s, x in zip(stats, labels) if x == c], depth)}
                              for c in dict.fromkeys(labels)}
    return out


def engine_nodes(tree) -> int:
    return 0 if tree is None else tree.num_nodes


def bench_tpc(model: str, drafts: list[str], speculations: list[str], prompts_path: str,
              temperatures: list[float], max_tokens: int = 128, limit: int | None = None, device: str = "auto",
              dtype: str = "auto", batch_size: int = 80, seed: int = 0, out: str | None = None,
              kv_cache_bytes: int | None = None, log=print, draft_quant: str | None = None,
              guided: bool = True) -> dict:
    from eyas.loader.eagle import load_draft
    from eyas.loader.resolve import draft_dir, load_target
    from eyas.spec.draft_quant import apply_draft_quant, check_quant_mode
    from eyas.spec.ngram import ngram_proposer

    check_quant_mode(draft_quant)

    target, tok = load_target(model, device, dtype)
    if tok is None or not tok.chat_template:
        raise ValueError(f"model {model!r} has no chat template; `bench tpc` prompts through it")
    records = read_prompts(prompts_path, limit)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": r["text"]}]), add_bos=False)
               for r in records]
    results = []
    for dname in drafts:
        draft = ngram_proposer(dname)  # n-gram proposals (eyas.spec.ngram): no draft model
        if draft is None:
            draft = apply_draft_quant(load_draft(draft_dir(model, dname), target), target, draft_quant)
        for temp in temperatures:  # every speculation at the first temperature first
            for spec in speculations:
                r = run_one(target, tok, draft, spec, prompts, temp, max_tokens, batch_size, seed, kv_cache_bytes,
                            [rec["category"] for rec in records],
                            [rec["guided"] if guided else None for rec in records])
                r["draft"] = dname
                r["draft_layers"] = draft.config.num_hidden_layers if hasattr(draft, "config") else 0
                if getattr(draft, "quant", None):  # asked, or the draft's own choice on this device
                    r["draft_quant"] = draft.quant
                results.append(r)
                log(f"draft={dname} {spec} T={temp:g}: TPC {r['tpc']:.3f}  acceptance by depth "
                    + " ".join(f"{a:.3f}" for a in r["acceptance_by_depth"]) + f"  ({r['wall_seconds']:.1f} s)"
                    + (f"  guided {r['guided']}, {r['guided_valid']} of {r['guided_ended']} ended valid"
                       if "guided" in r else ""))
                if out:  # write as we go: a long run cut short still leaves its numbers
                    write_outputs(out, meta(model, prompts_path, records, max_tokens, device, target), results)
        del draft
    report = {**meta(model, prompts_path, records, max_tokens, device, target), "results": results}
    if out:
        write_outputs(out, report, results, plot=True)
    return report


def meta(model, prompts_path, records, max_tokens, device, target) -> dict:
    import torch
    p = next(target.parameters())
    dev = str(p.device) + (f" ({torch.cuda.get_device_name(p.device)})" if p.device.type == "cuda" else "")
    return {"model": model, "prompts": str(prompts_path), "num_prompts": len(records), "max_tokens": max_tokens,
            "device": dev, "dtype": str(p.dtype).removeprefix("torch."), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "torch": torch.__version__}


def markdown_table(results: list[dict]) -> str:
    depth = max((r["depth"] for r in results), default=0)
    guided = any("guided" in r for r in results)
    head = ["draft", "speculation", "T", "TPC", "TPC (per-prompt mean)"] + [f"acc@{d + 1}" for d in range(depth)]
    head += ["guided (valid / ended)"] if guided else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        acc = [f"{a:.3f}" for a in r["acceptance_by_depth"]] + [""] * (depth - r["depth"])
        acc += ([f"{r['guided']} ({r['guided_valid']} / {r['guided_ended']})" if "guided" in r else "no"]
                if guided else [])
        lines.append("| " + " | ".join([str(r["draft"]), r["speculation"], f"{r['temperature']:g}",
                                        f"{r['tpc']:.3f}", f"{r['tpc_mean_per_prompt']:.3f}"] + acc) + " |")
    return "\n".join(lines) + "\n"


def category_table(results: list[dict]) -> str:
    """TPC and depth-1 acceptance by prompt category, a column pair per result (empty without categories)."""
    rs = [r for r in results if r.get("by_category")]
    if not rs:
        return ""
    cats = list(dict.fromkeys(c for r in rs for c in r["by_category"]))
    heads = [f"{r['draft']} {r['speculation']} T={r['temperature']:g}" for r in rs]
    head = ["category", "prompts"] + [x for h in heads for x in (f"TPC ({h})", f"acc@1 ({h})")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cats:
        n = next(r["by_category"][c]["prompts"] for r in rs if c in r["by_category"])
        cells = []
        for r in rs:
            b = r["by_category"].get(c)
            cells += [f"{b['tpc']:.3f}", f"{b['acceptance_by_depth'][0]:.3f}" if b["acceptance_by_depth"] else ""] \
                if b else ["", ""]
        lines.append("| " + " | ".join([c, str(n)] + cells) + " |")
    return "\n".join(lines) + "\n"


def plot_acceptance(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in results})
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for r in results:
            if r["temperature"] != t:
                continue
            xs = list(range(1, r["depth"] + 1))
            ax.plot(xs, r["acceptance_by_depth"], marker="o",
                    label=f"{r['draft']} {r['speculation']} (TPC {r['tpc']:.2f})")
        ax.set_title(f"temperature {t:g}")
        ax.set_xlabel("depth")
        ax.set_ylabel("share of steps reaching depth")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: str | Path, report: dict, results: list[dict], plot: bool = False) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(report, results=results)
    (out / "tpc.json").write_text(json.dumps(report, indent=2))
    by_cat = category_table(results)
    (out / "tpc.md").write_text(f"TPC on {report['num_prompts']} prompts of {report['prompts']}, {report['max_tokens']} "
                                f"new tokens, model {report['model']}, {report['device']} {report['dtype']}, "
                                f"{report['date']}\n\n" + markdown_table(results)
                                + (f"\nBy prompt category:\n\n{by_cat}" if by_cat else ""))
    if plot and results:
        plot_acceptance(results, out / "acceptance.png")


# ---- CLI ---------------------------------------------------------------------------------------------------------

def add_tpc_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Register `tpc` on the subparsers of `eyas bench`."""
    p = bench_subparsers.add_parser("tpc", help="tokens per target call and acceptance by depth on a prompt set",
                                    description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--draft", nargs="+", default=["default"],
                   help="EAGLE draft directories, 'default', or 'ngram' / 'ngram:N_MIN:N_MAX' (n-gram proposals: no "
                        "draft model)")
    p.add_argument("--speculation", action="append", default=None,
                   help="chain:K | tree:NAME | tree JSON | dyn:kKdDnN; repeat for several (default chain:3)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--temperature", nargs="+", type=float, default=[0.0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    p.add_argument("--batch-size", type=int, default=80, help="prompts generated together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    from eyas.spec.draft_quant import add_draft_quant_arg
    add_draft_quant_arg(p, "quantize every draft (eyas.spec.draft_quant) and measure what that costs in acceptance")
    p.add_argument("--no-guided", dest="guided", action="store_false",
                   help="ignore the prompt file's guides (json_schema, regex, ...): the same prompts unconstrained")
    p.add_argument("--out", default="bench-out/tpc")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    report = bench_tpc(args.model, args.draft, args.speculation or ["chain:3"], args.prompts, args.temperature,
                       args.max_tokens, args.limit, args.device, args.dtype, args.batch_size, args.seed, args.out,
                       args.kv_cache_bytes, log=lambda m: print(m, flush=True), draft_quant=args.draft_quant,
                       guided=args.guided)
    print(markdown_table(report["results"]))
    print(f"written to {args.out}/tpc.json, tpc.md, acceptance.png")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eyas.bench.tpc")
    add_tpc_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tpc", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as e:
        print(f"eyas bench tpc: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
