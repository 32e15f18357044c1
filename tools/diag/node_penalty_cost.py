"""What penalising a tree's nodes costs (`Penalties.apply_to_nodes`: each of L nodes by the committed tokens and its
own path's), per call: B rows of 1,300 prompt + 300 output random tokens, repetition 1.2 + frequency 0.3, L nodes of
a path of M tokens each about a fifth of which are on a node's path, the whole vocabulary (as the target's verify
logits are penalised). Median of `--repeat` calls. Run it against another tree with PYTHONPATH to compare versions
(it uses only `Penalties.of` and `apply_to_nodes`, which session 52's code has too). A record of costs.

    PYTHONPATH=. python3 tools/diag/node_penalty_cost.py [--device cpu] [--batch-sizes 1,8,32] [--out cost.json]
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_rows import emit, median_ms, random_seqs, save  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--nodes", type=int, default=49)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from eyas import SamplingParams
    from eyas.layers.penalties import Penalties

    dev = torch.device(args.device)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3)
    L, M = args.nodes, args.nodes - 1
    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        pen = Penalties.of(random_seqs(rng, B, 1300, 300, args.vocab, params), args.vocab, dev)
        logits = torch.randn(B, L, args.vocab, generator=g).to(dev)
        tokens = torch.randint(0, args.vocab, (B, M), generator=g).to(dev)
        on_path = (torch.rand(L, M, generator=g) < 0.2).to(dev)
        ms = median_ms(lambda x: pen.apply_to_nodes(x, tokens, on_path), args.repeat, dev, setup=logits.clone)
        emit(rows, dict(batch=B, nodes=L, ms=round(ms, 2)))
    save(args.out, args, rows, device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")


if __name__ == "__main__":
    main()
