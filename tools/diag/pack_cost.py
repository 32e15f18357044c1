"""Host time of `eyas.engine.prefill_graph.pack` (a prefill chunk's inputs, built before every prefill step): random
tokens, batches of 1 and 16, the block tables of a 8k context. Session 62's rows: docs/benchmarks.md, "Session 62".
  PYTHONPATH=. python3 tools/diag/pack_cost.py [--repeat 300]"""
from __future__ import annotations

import argparse
import random
import time

from eyas.engine.prefill_graph import pack


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=300)
    args = p.parse_args()
    rng = random.Random(0)
    width = 520  # 8,192 tokens and the lookahead in 16-token blocks
    for B, Q, n in [(1, 128, 100), (16, 160, 130), (16, 512, 300)]:
        rows = [[rng.randrange(49152) for _ in range(n)] for _ in range(B)]
        tables = [list(range(i * 40, i * 40 + -(-n // 16))) for i in range(B)]
        call = (rows, [0] * B, [n] * B, tables, B, Q, width, list(range(B)), [0] * B)
        for _ in range(20):
            pack(*call, pad_slot=64)
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            pack(*call, pad_slot=64)
        print(f"batch {B}, {n} tokens a row, padded to {Q}: {(time.perf_counter() - t0) / args.repeat * 1e6:.1f} us")


if __name__ == "__main__":
    main()
