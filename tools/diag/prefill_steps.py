"""What the prefill steps of an `eyas bench latency` run were: each chunk's shape, whether it ran padded (graphed, or
eager at the graph's shape where no graph is kept) or at its own shape, and what it cost; and every prefill graph
captured, with how long its capture took.

The arguments are `eyas bench latency`'s, which runs unchanged with `ModelRunner._prefill_forward` and
`PrefillGraphs._capture` wrapped (a device synchronisation around each, so the steps' times are their own). A step's
key is its padded (batch, length) or, at its own shape, (batch, longest chunk, tokens); "later" marks chunks after a
prefix (since session 63 captured ahead too, by `capture_all`). The maximum shows a capture or a Triton
compile that the mean hides. Session 62 found with it that SmolLM2's MT-Bench waves of 16 prefilled eagerly
(docs/benchmarks.md, "Session 62").
  PYTHONPATH=. python3 tools/diag/prefill_steps.py --model smollm2 --draft default --prompts question.jsonl \\
      --num-prompts 80 --max-tokens 16 --batch-sizes 16 --modes plain --out /tmp/steps"""
from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

import eyas.engine.prefill_graph as pg
from eyas.engine.runner import ModelRunner


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def instrument():
    """Wrap the runner's prefill forward and the prefill graphs' capture; returns (steps, captures): key -> list of
    ms, and a list of (graph key, ms)."""
    steps, captures = defaultdict(list), []
    capture, forward = pg.PrefillGraphs._capture, ModelRunner._prefill_forward

    def timed_capture(self, key):
        _sync()
        t0 = time.perf_counter()
        out = capture(self, key)
        _sync()
        captures.append((key, (time.perf_counter() - t0) * 1e3))
        return out

    def timed_forward(self, seqs, chunk_lens):
        B, Q = len(seqs), max(chunk_lens)
        shape = pg.prefill_shape(B, Q, self.prefill_tokens) if self.pad_prefill else None
        later = any(s.num_cached > 0 for s in seqs)
        key = (("padded", *shape) if shape else ("own", B, Q, sum(chunk_lens))) + (("later",) if later else ())
        _sync()
        t0 = time.perf_counter()
        out = forward(self, seqs, chunk_lens)
        _sync()
        steps[key].append((time.perf_counter() - t0) * 1e3)
        return out

    pg.PrefillGraphs._capture = timed_capture
    ModelRunner._prefill_forward = timed_forward
    return steps, captures


def report(steps, captures) -> str:
    lines = ["| step | count | mean ms | max ms |", "| --- | --- | --- | --- |"]
    for key, ms in sorted(steps.items(), key=str):
        lines.append(f"| {' '.join(map(str, key))} | {len(ms)} | {sum(ms) / len(ms):.2f} | {max(ms):.2f} |")
    later = [(k, ms) for k, ms in captures if k[2] > 0]
    lines.append(f"\n{len(captures)} prefill graphs captured ({sum(ms for _, ms in captures) / 1e3:.2f} s), "
                 f"{len(later)} after a prefix: " + ", ".join(f"{k} {ms:.0f} ms" for k, ms in later))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from eyas.cli import main as cli
    steps, captures = instrument()
    rc = cli(["bench", "latency"] + argv)
    print(report(steps, captures))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
