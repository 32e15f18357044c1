"""Where in an answer does the draft miss? Depth-1 top-1 accuracy by position in the answer and by MT-Bench category,
from a rank-path recording (`eyas make-tree --eval-data ANSWERS --save-eval-ranks RANKS`: one row per answer token,
in the answers' order) and the answers it was recorded on (`input_ids` + `loss_mask` JSON lines).
    PYTHONPATH=. python3 tools/diag/acc_by_position.py RANKS ANSWERS [QUESTIONS]"""
import json
import sys

import torch

from eyas.bench.latency import load_ranks


def main(ranks_path: str, answers_path: str, questions_path: str | None = None) -> None:
    ranks = load_ranks(ranks_path)
    lens = [sum(json.loads(line)["loss_mask"]) for line in open(answers_path) if line.strip()]
    if sum(lens) != len(ranks):
        raise SystemExit(f"{answers_path} has {sum(lens)} answer tokens, {ranks_path} {len(ranks)} rows")
    pos = torch.cat([torch.arange(n) for n in lens])
    top1 = (ranks[:, 0] == 0).float()
    edges = [0, 16, 32, 64, 96, 128, 256, 512, 1 << 30]
    for a, b in zip(edges, edges[1:]):
        m = (pos >= a) & (pos < b)
        if m.any():
            print(json.dumps({"positions": [a, min(b, int(pos.max()) + 1)], "tokens": int(m.sum()),
                              "depth1_top1": round(top1[m].mean().item(), 3)}))
    if questions_path:
        cats = [json.loads(line)["category"] for line in open(questions_path) if line.strip()][:len(lens)]
        ends = torch.tensor([0] + lens).cumsum(0)
        by: dict[str, list] = {}
        for i, c in enumerate(cats):
            by.setdefault(c, []).append(top1[ends[i]:ends[i + 1]])
        print(json.dumps({c: round(torch.cat(v).mean().item(), 3) for c, v in by.items()}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
