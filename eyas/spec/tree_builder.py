"""`eyas make-tree`: a static speculation tree fitted to a draft, from the ranks its proposals take on real text.

At temperature 0 a step commits the deepest tree node whose whole path of ranks matches the target's greedy tokens.
For a chain rooted at position t of a text the target wrote itself, let r_d be the rank, in the draft's proposal at
depth d, of the target's greedy token there, the draft having read the true tokens up to it (exactly what the draft
computes on the tree path that matches them). A tree (an ancestor-closed set of rank paths) then accepts
`sum over its nodes of 1[(r_1..r_d) == node]` tokens at t, so its expected accepted length is the sum of its nodes'
frequencies among the roots' rank paths, and TPC = 1 + that. The N most frequent rank-path prefixes are the best tree
of N nodes for this objective (a prefix is at least as frequent as its extensions, so they are ancestor-closed), which
`best_tree` picks. EAGLE's `mc_sim_7b_63` was fitted the same way to Vicuna-7B's draft; this fits ours.

`rank_paths` reads the ranks off the draft's unrolled streams (`eyas.train.trainer.unrolled_streams`: stream d at
index p is the draft's d-th chain step along the true tokens, rooted at p - d + 1), one target pass per batch.
The estimate averages over every position; a decode step is rooted only where the previous step ended, so measured
TPC differs somewhat (`docs/benchmarks.md` compares the two).
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eyas.spec.draft_vocab import draft_full_logits

MISS = -1  # rank path entry: the target's token was not among the draft's top `max_rank` proposals


@torch.no_grad()
def rank_paths(target, draft, examples, depth: int, max_rank: int, batch_tokens: int = 4096,
               per_example: bool = False):
    """[R, depth] int64: for every root t whose first prediction is an assistant token, the rank of the target's
    greedy token among the draft's proposals at depths 1..depth (MISS past `max_rank`, or where the chain leaves the
    text or its assistant part, and after the first MISS). Root t's depth 1 proposes token t + 2, so an example
    whose answer starts at P has roots P - 2, P - 1, ...; the first decode step is rooted at P - 1 (the prefill
    produced token P). `per_example`: a list of each example's [roots, depth], in the examples' order."""
    from eyas.train.data import collate, length_batches
    from eyas.train.trainer import draft_inputs, unrolled_streams

    dev = next(target.parameters()).device
    out: list = [None] * len(examples)
    for batch in length_batches([len(e) for e in examples], batch_tokens):
        ids, amask = collate(examples, batch)
        ids, amask = ids.to(dev), amask.to(dev)
        emb, feats, pos, h_next, lmask = draft_inputs(target, ids, amask, draft.feature_layers)
        streams = unrolled_streams(draft, emb, feats.to(emb.dtype), pos, depth)
        t_arg = target.compute_logits(h_next).argmax(-1)  # [B, T-1]: the target's token predicted at each index
        B, T1 = t_arg.shape
        ranks = torch.full((B, T1, depth), MISS, dtype=torch.long, device=dev)  # [root t, depth d]
        for d, s in enumerate(streams):  # stream d+1 at index p is depth d+1 of the chain rooted at p - d
            logits = draft_full_logits(draft, target, s.to(h_next.dtype))
            own = logits.gather(-1, t_arg[..., None])
            r = (logits > own).sum(-1)  # [B, T-1] rank of the target's token
            ok = (r < max_rank) & lmask & torch.isfinite(own[..., 0])  # -inf: outside a draft vocabulary
            r = torch.where(ok, r, torch.full_like(r, MISS))
            ranks[:, : T1 - d, d] = r[:, d:]
        # after the first miss nothing deeper can be accepted
        ranks = torch.where((ranks == MISS).cumsum(-1) > 0, torch.full_like(ranks, MISS), ranks).cpu()
        lm = lmask.cpu()
        for b, ex_i in enumerate(batch):
            out[ex_i] = ranks[b][lm[b]]  # [roots, depth]
    if per_example:
        return out
    return torch.cat(out) if out else torch.zeros(0, depth, dtype=torch.long)


def _steps(paths: torch.Tensor, tree: list[list[int]], max_tokens: int):
    """The decode steps of greedy speculative decoding with `tree` over one example's rank paths: yields (the root's
    rank path, tokens the step commits)."""
    nodes = {tuple(p) for p in tree}
    rows = paths.tolist()
    depth = paths.shape[-1]
    t, produced = 1, 1  # local root 1 = the answer's first token is the last committed one
    while produced < max_tokens:
        row = rows[t] if t < len(rows) else [MISS] * depth
        a = 0
        while a < len(row) and row[a] != MISS and tuple(row[: a + 1]) in nodes:
            a += 1
        n = min(a + 1, max_tokens - produced)
        yield row, n
        produced, t = produced + n, t + a + 1


def replay(paths: torch.Tensor, tree: list[list[int]], max_tokens: int) -> tuple[int, int]:
    """Greedy speculative decoding with `tree` replayed over one example's rank paths (`rank_paths(per_example=
    True)`), producing `max_tokens` tokens (the answer's length; the prefill gives the first): each step accepts the
    longest tree path its root's rank path matches and commits it plus the target's own next token. -> (target calls,
    tokens they committed), which the engine reproduces exactly (tests/test_tree_builder.py)."""
    steps = [n for _, n in _steps(paths, tree, max_tokens)]
    return len(steps), sum(steps)


def refit(paths_per_example: list[torch.Tensor], answer_lengths: list[int], num_nodes: int,
          max_depth: int | None = None, min_count: int = 3, rounds: int = 3) -> tuple[list[list[int]], float]:
    """The best tree of `num_nodes` for the roots decoding actually visits. `best_tree` weighs every position alike,
    but a step is rooted only where the previous one ended, and positions inside long accepted runs (easy text) are
    rarely roots: fitting on all positions overrates deep paths. Starting from `best_tree` on all positions, each
    round refits on the roots that decoding with the current tree visits (its replay); the tree of the highest
    replayed TPC on these examples is returned, with that TPC."""
    tree = best_tree(torch.cat(paths_per_example), num_nodes, max_depth, min_count)
    best = (replayed_tpc(paths_per_example, answer_lengths, tree), tree)
    for _ in range(rounds):
        roots = [row for p, n in zip(paths_per_example, answer_lengths) for row, _ in _steps(p, tree, n)]
        tree = best_tree(torch.tensor(roots, dtype=torch.long), num_nodes, max_depth, max(1, min_count - 1))
        tpc = replayed_tpc(paths_per_example, answer_lengths, tree)
        if tpc > best[0]:
            best = (tpc, tree)
    return best[1], best[0]


def replayed_tpc(paths_per_example: list[torch.Tensor], answer_lengths: list[int], tree: list[list[int]]) -> float:
    """TPC as `eyas bench tpc` sums it (committed over target calls, all requests) for greedy decoding with `tree`,
    replayed over the rank paths of the target's own answers."""
    calls = committed = 0
    for p, n in zip(paths_per_example, answer_lengths):
        c, k = replay(p, tree, n)
        calls, committed = calls + c, committed + k
    return committed / max(calls, 1)


def prefix_counts(paths: torch.Tensor) -> Counter:
    """How many roots each rank-path prefix (a tree node) matches."""
    c: Counter = Counter()
    for row in paths.tolist():
        pre: tuple[int, ...] = ()
        for r in row:
            if r == MISS:
                break
            pre = pre + (r,)
            c[pre] += 1
    return c


def best_tree(paths: torch.Tensor, num_nodes: int, max_depth: int | None = None,
              min_count: int = 1) -> list[list[int]]:
    """The `num_nodes` most frequent rank-path prefixes (at most `max_depth` deep, matched by >= `min_count` roots):
    the tree of that size with the largest expected accepted length on these paths. Ties go to the shallower, then
    the lexicographically smaller path, which keeps the set ancestor-closed."""
    if num_nodes < 1:
        raise ValueError("a tree needs at least one node")
    c = prefix_counts(paths)
    cand = [(p, n) for p, n in c.items() if n >= min_count and (max_depth is None or len(p) <= max_depth)]
    cand.sort(key=lambda pn: (-pn[1], len(pn[0]), pn[0]))
    return [list(p) for p, _ in cand[:num_nodes]]


def expected_tpc(paths: torch.Tensor, tree: list[list[int]]) -> float:
    """1 + the mean accepted length of `tree` over the roots' rank paths (greedy)."""
    if len(paths) == 0:
        return 1.0
    c = prefix_counts(paths)
    return 1.0 + sum(c.get(tuple(p), 0) for p in tree) / len(paths)


@dataclass
class StepCost:
    """Milliseconds per speculative step as a linear model of the tree's shape: `base` (the target's verify forward,
    acceptance, the draft's catch-up) + `per_level` x depth (a draft forward per level) + `per_node` x nodes + `per_topk`
    x levels whose nodes need more than one candidate (a top-k instead of an argmax). The paper's lesson as a tool:
    the best tree minimises step cost / TPC, not the TPC alone."""
    base: float
    per_level: float
    per_node: float
    per_topk: float = 0.0

    @staticmethod
    def features(tree) -> list[float]:
        return [1.0, float(tree.max_depth), float(tree.num_nodes), float(sum(k > 1 for k in tree.topk_per_level))]

    def ms(self, paths: list[list[int]]) -> float:
        from eyas.spec.tree import Tree
        weights = (self.base, self.per_level, self.per_node, self.per_topk)
        return sum(w * f for w, f in zip(weights, self.features(Tree.from_paths(paths))))

    @classmethod
    def parse(cls, text: str) -> "StepCost":
        """`BASE,PER_LEVEL,PER_NODE[,PER_TOPK]` in ms, or an `eyas bench latency` JSON to fit them from (`fit`)."""
        if Path(text).suffix == ".json" or Path(text).exists():
            return cls.fit(json.loads(Path(text).read_text())["results"])
        try:
            vals = [float(x) for x in text.split(",")]
        except ValueError:
            vals = []
        if len(vals) not in (3, 4):
            raise ValueError(f"--step-cost {text!r}: give BASE,PER_LEVEL,PER_NODE[,PER_TOPK] in ms or a latency JSON")
        return cls(*vals)

    @classmethod
    def fit(cls, rows: list[dict], batch: int = 1) -> "StepCost":
        """Least squares over `eyas bench latency` rows (mode, batch, ms_per_decode_step) of speculative modes at
        `batch`; plain and dispatch rows are skipped. Needs at least 4 trees of different shapes."""
        from eyas.spec.tree import resolve_tree
        X, y = [], []
        for r in rows:
            if r["batch"] != batch or r["mode"] == "plain" or r["mode"].startswith("dispatch:"):
                continue
            X.append(cls.features(resolve_tree(r["mode"])))
            y.append(r["ms_per_decode_step"])
        if len(X) < 4:
            raise ValueError(f"fitting a step cost needs >= 4 speculative rows at batch {batch}, got {len(X)}")
        sol = torch.linalg.lstsq(torch.tensor(X, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)[:, None])
        return cls(*(round(float(v), 5) for v in sol.solution.flatten()))


def make_tree(model: str, draft: str, data: list[str], out: str, nodes: list[int], max_depth: int | list[int] = 8,
              max_rank: int = 10, min_count: int = 3, limit: int | None = None, device: str = "auto",
              dtype: str = "auto", compare: list[str] | None = None, eval_data: list[str] | None = None,
              refit_rounds: int = 3, step_cost: StepCost | None = None, save_eval_ranks: str | None = None,
              draft_quant: str | None = None) -> dict:
    """Fit trees of each size in `nodes` to `draft` on the conversations of `data` (the target's own answers, e.g.
    `eyas make-distill-data` output, kept out of the draft's training); writes `out` (one size: a JSON list of paths,
    which `--speculation` takes; several: OUT_STEM-N.json each) and returns the fit, with the expected TPC of the
    `compare` speculations (`chain:K`, `tree:NAME`) on the same paths. Each tree is `refit` for `refit_rounds`
    rounds (chosen by its replayed TPC on `data`, never on `eval_data`). `eval_data`: the target's greedy answers to
    other prompts (one assistant turn each, e.g. MT-Bench's, at the bench's max tokens), on which every tree's and
    speculation's TPC is replayed exactly as the engine would measure it in this dtype.
    Several `max_depth` values fit a tree per (size, depth limit). `step_cost`: every tree also gets its predicted
    ms per step and per token (step cost / TPC replayed on `data`), and the one of the least ms per token is written
    to `out` itself (the others as OUT_STEM-N[dD].json): chosen on the fit data, never on `eval_data`.
    `draft_quant`: fit and replay the draft quantized so (`eyas.spec.draft_quant`), e.g. to record its rank paths."""
    from eyas.loader.eagle import load_draft
    from eyas.spec.draft_quant import apply_draft_quant, check_quant_mode
    from eyas.loader.resolve import draft_dir, load_target, resolve_device, resolve_dtype
    from eyas.spec.tree import resolve_tree
    from eyas.train.data import load_examples

    check_quant_mode(draft_quant)
    dev = resolve_device(device)
    target, tok = load_target(model, dev, resolve_dtype(dtype, dev))
    d = apply_draft_quant(load_draft(draft_dir(model, draft), target).to(dev).eval(), target, draft_quant)
    exs = load_examples(data, tok, limit=limit, workers=1)
    if not exs:
        raise ValueError(f"no usable conversations in {data}")
    depths = [max_depth] if isinstance(max_depth, int) else list(max_depth)
    per_fit = rank_paths(target, d, exs, max(depths), max_rank, per_example=True)
    len_fit = [int(e.mask.sum()) for e in exs]
    paths = torch.cat(per_fit)
    res = {"roots": len(paths), "conversations": len(exs), "max_depth": depths if len(depths) > 1 else depths[0],
           "max_rank": max_rank, "min_count": min_count, "refit_rounds": refit_rounds, "trees": {}, "compare": {}}
    if step_cost is not None:
        res["step_cost_ms"] = asdict(step_cost)
    outp = Path(out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    trees: dict[str, list[list[int]]] = {}  # fitted (by size) and compared (by speculation)
    several = len(nodes) * len(depths) > 1
    for n in nodes:
        for depth in depths:
            key = str(n) if len(depths) == 1 else f"{n}d{depth}"
            tree, fit_tpc = refit(per_fit, len_fit, n, depth, min_count, refit_rounds)
            path = outp.with_name(f"{outp.stem}-{key}{outp.suffix or '.json'}") if several else outp
            path.write_text(json.dumps(tree) + "\n")
            trees[key] = tree
            res["trees"][key] = {"file": str(path), "nodes": len(tree), "depth": max(len(p) for p in tree),
                                 "expected_tpc": round(expected_tpc(paths, tree), 4),
                                 "replayed_tpc_on_data": round(fit_tpc, 4)}
            if step_cost is not None:
                ms = step_cost.ms(tree)
                res["trees"][key].update(predicted_ms_per_step=round(ms, 4),
                                         predicted_ms_per_token=round(ms / fit_tpc, 4))
    if step_cost is not None and several:  # the least predicted ms per token on the fit data goes to `out`
        best = min(res["trees"], key=lambda k: res["trees"][k]["predicted_ms_per_token"])
        outp.write_text(json.dumps(trees[best]) + "\n")
        res["best"] = {"tree": best, "file": str(outp)}
    for spec in compare or []:
        trees[spec] = [list(p) for p in resolve_tree(spec).paths]
        tpc = replayed_tpc(per_fit, len_fit, trees[spec])
        res["compare"][spec] = {"expected_tpc": round(expected_tpc(paths, trees[spec]), 4),
                                "replayed_tpc_on_data": round(tpc, 4)}
        if step_cost is not None:
            res["compare"][spec]["predicted_ms_per_token"] = round(step_cost.ms(trees[spec]) / tpc, 4)
    if eval_data:
        ev = load_examples(eval_data, tok, workers=1)
        per = rank_paths(target, d, ev, max(depths), max_rank, per_example=True)
        lengths = [int(e.mask.sum()) for e in ev]
        res["eval"] = {"conversations": len(ev), "answer_tokens": sum(lengths),
                       "replayed_tpc": {k: round(replayed_tpc(per, lengths, t), 4) for k, t in trees.items()}}
        if save_eval_ranks:  # the recording `eyas bench latency --accept-ranks` replays on random-weight shapes
            from safetensors.torch import save_file
            Path(save_eval_ranks).parent.mkdir(parents=True, exist_ok=True)
            save_file({"ranks": torch.cat(per).to(torch.int8).contiguous()}, save_eval_ranks,
                      metadata={"draft": str(draft), "eval_data": " ".join(eval_data), "max_rank": str(max_rank)})
            res["eval"]["ranks_file"] = save_eval_ranks
    return res


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `make-tree` on the eyas CLI's subparsers."""
    p = subparsers.add_parser("make-tree", help="fit a static speculation tree to a draft",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--draft", default="default")
    p.add_argument("--data", nargs="+", required=True,
                   help="conversations answered by the target itself (make-distill-data output), not trained on")
    p.add_argument("--out", required=True,
                   help="tree JSON (several --nodes/--max-depth: OUT_STEM-N[dD].json each; with --step-cost the "
                        "fastest of them is also written to OUT)")
    p.add_argument("--nodes", type=int, nargs="+", default=[64])
    p.add_argument("--max-depth", type=int, nargs="+", default=[8], help="depth limits: a tree per size and limit")
    p.add_argument("--step-cost", default=None,
                   help="BASE,PER_LEVEL,PER_NODE[,PER_TOPK] ms per step, or an `eyas bench latency` JSON of several "
                        "trees at batch 1 to fit them from: pick the tree of the least predicted ms per token")
    p.add_argument("--max-rank", type=int, default=10, help="proposals per node considered")
    p.add_argument("--min-count", type=int, default=3, help="keep nodes matched by at least this many roots")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--compare", nargs="*", default=["chain:3", "tree:8", "tree:16", "tree:mc_sim_7b_63"])
    p.add_argument("--refit-rounds", type=int, default=3, help="refit on the roots decoding visits (0: none)")
    p.add_argument("--eval-data", nargs="*", default=None,
                   help="the target's greedy answers to other prompts: replay every tree's TPC on them")
    p.add_argument("--save-eval-ranks", default=None,
                   help="write the rank paths of --eval-data (safetensors `ranks` [T, depth]): the acceptance profile "
                        "that `eyas bench latency --accept-ranks` replays on random-weight shapes")
    from eyas.spec.draft_quant import add_draft_quant_arg
    add_draft_quant_arg(p, "the draft quantized (eyas.spec.draft_quant): its rank paths, fits and replays")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    if min(args.nodes) < 1 or min(args.max_depth) < 1 or args.max_rank < 1:
        raise ValueError("--nodes, --max-depth and --max-rank must be >= 1")
    cost = StepCost.parse(args.step_cost) if args.step_cost else None
    if args.save_eval_ranks and not args.eval_data:
        raise ValueError("--save-eval-ranks needs --eval-data")
    print(json.dumps(make_tree(args.model, args.draft, args.data, args.out, args.nodes, args.max_depth, args.max_rank,
                               args.min_count, args.limit, args.device, args.dtype, args.compare, args.eval_data,
                               args.refit_rounds, cost, args.save_eval_ranks, args.draft_quant), indent=2))
    return 0


def main(argv=None) -> int:
    from eyas.cli import subcommand_main
    return subcommand_main(add_parser, "make-tree", "eyas.spec.tree_builder", argv)


if __name__ == "__main__":
    raise SystemExit(main())
