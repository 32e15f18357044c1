"""What a decode step's penalties cost to make, per step, before its kernels run: `Penalties.of` (the rows made from
every token of every row: host index arrays, one copy, scatters; what each decode step did until session 53) against
the per-slot device rows of `PenaltyState` in their steady state (rows made once; a step gathers them by slot, and
`commit` adds its tokens on the device). docs/benchmarks.md's "Session 53" figures ran 15b189c, whose `Penalties.of`
made fewer rows (no stop tokens). B sequences of `--prompt` + `--output` random tokens, repetition 1.2 and frequency 0.3, SmolLM2's
vocabulary; each figure is the median over `--repeat` calls (synchronised on CUDA). A record of costs, not a fast path.

    PYTHONPATH=. python3 tools/diag/penalty_host_cost.py [--device cuda] [--batch-sizes 1,8,32] [--out cost.json]
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
    ap.add_argument("--prompt", type=int, default=1300)
    ap.add_argument("--output", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from eyas import SamplingParams
    from eyas.layers.penalties import Penalties, PenaltyState

    dev = torch.device(args.device)
    rng = random.Random(0)
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3)

    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        seqs = random_seqs(rng, B, args.prompt, args.output, args.vocab, params)
        state = PenaltyState(B, args.vocab, dev)
        slots = torch.arange(B, device=dev)
        state.penalties(seqs, slots)  # the rows made once
        of_ms = median_ms(lambda: Penalties.of(seqs, args.vocab, dev), args.repeat, dev)
        rows_ms = median_ms(lambda: state.penalties(seqs, slots), args.repeat, dev)
        emit(rows, dict(batch=B, context=args.prompt + args.output, penalties_of_ms=round(of_ms, 3),
                        state_rows_ms=round(rows_ms, 3)))
    save(args.out, args, rows, device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")


if __name__ == "__main__":
    main()
