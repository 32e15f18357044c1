"""Host time of two per-step checks that session 51 added, on this machine's CPU (timeit, median of 5 runs):

* the prefix-cache lookup of a waiting request (`Scheduler._prefix_hit`), which runs at every step while the request
  waits (twice with overlapped decoding): a 16,000-token prompt whose first 999 blocks of 16 are cached, looked up
  afresh (`prefix_memo` cleared) and memoised (the cache unchanged since the last lookup);
* the runner's test of whether a decode step needs an eager run (any request asking for log-probabilities or
  penalties), at batch 1 and 64, none asking.
Prints one JSON line.

    python tools/diag/scheduler_host_cost.py
"""
from __future__ import annotations

import json
import statistics
import timeit

from eyas import SamplingParams
from eyas.cache.block_manager import BlockManager
from eyas.engine.scheduler import Scheduler
from eyas.engine.sequence import Sequence
from eyas.layers.penalties import Penalties


def us(fn, number: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    bm = BlockManager(4096, 16, prefix_caching=True)
    sched = Scheduler(bm, 4, 2048, 4, with_draft=True)
    seq = Sequence(list(range(16000)), SamplingParams(max_tokens=2), 0)
    table, parent = [], 0
    bm.reserve(table, 16000)
    for b in range(999):
        parent = bm.prefix.insert(table[b], parent, tuple(range(b * 16, (b + 1) * 16 + 1)))
    assert len(sched._prefix_hit(seq)[0]) == 999

    def fresh():
        seq.prefix_memo = None
        sched._prefix_hit(seq)

    out = {"lookup_16k_999_cached_us": us(fresh, 20), "lookup_memoised_us": us(lambda: sched._prefix_hit(seq), 10000)}
    for B in (1, 64):
        seqs = [Sequence([1, 2, 3], SamplingParams(max_tokens=10), 0) for _ in range(B)]

        def check():  # what ModelRunner.launch asks of the batch
            max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
            Penalties.of(seqs, 49152, "cpu")

        out[f"eager_check_batch{B}_us"] = us(check, 10000)
    print(json.dumps({k: round(v, 2) for k, v in out.items()}))


if __name__ == "__main__":
    main()
