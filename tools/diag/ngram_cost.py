"""The host's cost of n-gram proposals (`eyas.spec.ngram`) per sequence and step: a scan of the whole context
(`propose`, the first version's) against the per-sequence index (`NgramIndex`, what the engine uses), which takes
the tokens added since the last step. Random tokens of a 49,152-token vocabulary (few matches: the scan's worst
case), one token added a step, k = 4, sizes 2..4.

    python tools/diag/ngram_cost.py [--contexts 500 2000 8000] [--steps 200]
"""
from __future__ import annotations

import argparse
import random
import time

from eyas.spec.ngram import NgramIndex, propose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[500, 2000, 8000])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(0)
    print("| context | scan, ms a sequence a step | index, us a sequence a step |")
    print("| --- | --- | --- |")
    for L in args.contexts:
        tokens = [rng.randrange(49152) for _ in range(L + args.steps)]
        seq = tokens[:L]
        t = time.perf_counter()
        for i in range(args.steps):
            seq.append(tokens[L + i])  # the list grows in place, as Sequence.token_ids does
            propose(seq, 4)
        scan = (time.perf_counter() - t) / args.steps
        seq = tokens[:L]
        index = NgramIndex()
        index.propose(seq, 4)  # indexed up to here once, as a running sequence is
        t = time.perf_counter()
        for i in range(args.steps):
            seq.append(tokens[L + i])  # the list grows in place, as Sequence.token_ids does
            index.propose(seq, 4)
        indexed = (time.perf_counter() - t) / args.steps
        print(f"| {L} | {scan * 1e3:.3f} | {indexed * 1e6:.1f} |")


if __name__ == "__main__":
    main()
