"""Where does the draft miss? Its depth-1 acceptance (greedy: the target's token is the draft's top-1) binned by
the target's own probability of that token, on SmolLM2's greedy answers to MT-Bench's first turns (the data of
`eyas make-tree --eval-data`: a jsonl of input_ids + loss_mask, or conversations), float32 on the CPU. A second
table bins it by the token's index in its answer, where the held-out accuracy of the trainer (whole answers) and
MT-Bench's TPC (the first 128 tokens) differ.
    PYTHONPATH=. python3 tools/diag/acc_by_confidence.py answers.jsonl [--limit N] [--draft DIR]
        [--edges 0 0.3 0.5 0.7 0.9 0.99 1.01]   (from the repository root)"""
import argparse

import torch

from eyas.loader.eagle import load_draft
from eyas.loader.resolve import draft_dir, load_target
from eyas.train.data import collate, length_batches, load_examples
from eyas.train.trainer import draft_inputs, unrolled_streams


def fmt(x: float) -> str:
    return f"{x:.1f}" if round(x, 1) == x else f"{x:.2f}"


ap = argparse.ArgumentParser()
ap.add_argument("data", nargs="+")
ap.add_argument("--limit", type=int, default=None, help="read at most N records")
ap.add_argument("--draft", default="default", help="an EAGLE draft directory, or 'default' (the shipped one)")
ap.add_argument("--edges", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 0.9, 1.01],
                help="the bins of the target's probability")
args = ap.parse_args()
target, tok = load_target("smollm2", "cpu", torch.float32)
draft = load_draft(draft_dir("smollm2", args.draft), target).eval()
exs = load_examples(args.data, tok, limit=args.limit, workers=1)
pmax, hit, index = [], [], []
with torch.no_grad():
    for batch in length_batches([len(e) for e in exs], 4096):
        ids, amask = collate(exs, batch)
        emb, feats, pos, h_next, lmask = draft_inputs(target, ids, amask, draft.feature_layers)
        (s1,) = unrolled_streams(draft, emb, feats.to(emb.dtype), pos, 1)
        probs = target.compute_logits(h_next).float().softmax(-1)
        p, t_arg = probs.max(-1)
        d_arg = target.compute_logits(s1).argmax(-1)
        pmax.append(p[lmask])
        hit.append((d_arg == t_arg)[lmask])
        # the token's index in its answer: masked positions counted from each answer's start
        m = lmask.long()
        starts = m * (1 - torch.nn.functional.pad(m, (1, 0))[:, :-1])  # 1 where an answer begins
        run_id = starts.cumsum(-1)
        idx = m.cumsum(-1) - 1
        for r in range(m.shape[0]):
            first = torch.zeros(int(run_id[r].max()) + 1, dtype=torch.long)
            first.scatter_reduce_(0, run_id[r][m[r] == 1], idx[r][m[r] == 1], "amin", include_self=False)
            index.append((idx[r] - first[run_id[r]])[m[r] == 1])
pmax, hit, index = torch.cat(pmax), torch.cat(hit).float(), torch.cat(index)
print(f"positions {len(pmax)}, depth-1 acceptance {hit.mean():.3f}")
print("| target's p(greedy token) | share of positions | draft accepts | share of all misses |")
print("| --- | --- | --- | --- |")
edges = args.edges
misses = (1 - hit).sum()
for lo, hi in zip(edges, edges[1:]):
    m = (pmax >= lo) & (pmax < hi)
    if m.any():
        print(f"| {fmt(lo)}-{fmt(min(hi, 1.0))} | {m.float().mean():.3f} | {hit[m].mean():.3f} | "
              f"{(1 - hit[m]).sum() / misses:.3f} |")
print()
print("| token's index in its answer | share of positions | draft accepts |")
print("| --- | --- | --- |")
for lo, hi in zip([0, 16, 64, 128, 256, 512], [16, 64, 128, 256, 512, 1 << 30]):
    m = (index >= lo) & (index < hi)
    if m.any():
        print(f"| {lo}-{hi - 1 if hi < 1 << 30 else ''} | {m.float().mean():.3f} | {hit[m].mean():.3f} |")
