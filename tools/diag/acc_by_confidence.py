"""Where does the draft miss? Its depth-1 acceptance (greedy: the target's token is the draft's top-1) binned by
the target's own probability of that token, on SmolLM2's greedy answers to MT-Bench's first turns (the data of
`eyas make-tree --eval-data`: a jsonl of input_ids + loss_mask), float32 on the CPU.
    PYTHONPATH=. python3 tools/diag/acc_by_confidence.py answers.jsonl     (run from the repository root)"""
import sys

import torch

from eyas.loader.eagle import load_draft
from eyas.loader.resolve import draft_dir, load_target
from eyas.train.data import collate, length_batches, load_examples
from eyas.train.trainer import draft_inputs, unrolled_streams

target, tok = load_target("smollm2", "cpu", torch.float32)
draft = load_draft(draft_dir("smollm2", "default"), target).eval()
exs = load_examples(sys.argv[1:], tok, workers=1)
pmax, hit = [], []
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
pmax, hit = torch.cat(pmax), torch.cat(hit).float()
print(f"positions {len(pmax)}, depth-1 acceptance {hit.mean():.3f}")
print("| target's p(greedy token) | share of positions | draft accepts | share of all misses |")
print("| --- | --- | --- | --- |")
edges = [0.0, 0.3, 0.5, 0.7, 0.9, 1.01]
misses = (1 - hit).sum()
for lo, hi in zip(edges, edges[1:]):
    m = (pmax >= lo) & (pmax < hi)
    if m.any():
        print(f"| {lo:.1f}-{min(hi, 1.0):.1f} | {m.float().mean():.3f} | {hit[m].mean():.3f} | "
              f"{(1 - hit[m]).sum() / misses:.3f} |")
