"""`eyas serve` with its engine's steps timed: how long a step takes inside the server, where the HTTP side (the
event loop: the handlers, the streamed chunks) shares the process and its GIL with the engine loop's thread, and
how long the loop waits between two steps of a busy engine. Set beside `eyas bench latency`'s ms a step at the same
batch size (an engine alone), it says what serving costs a step; set beside `eyas bench serve`'s TTIT, what the
client sees.

On session 67's 2-core CPU (a 1-layer, hidden-32 model with a 64-word vocabulary, `OMP_NUM_THREADS=1`, greedy
requests of 512 tokens one at a time, runs alternated) a decode step took 0.77-1.0 ms alone, 1.09-1.12 ms inside
the server for non-streamed requests and 1.31-1.56 ms for streamed ones. The loop thread's own CPU time grew too
(1.02-1.05 and 1.14-1.35 ms), so the step waited (for the GIL or a core) only 0.07-0.2 ms of it. That machine's
client shares its two cores; the GPU machine's numbers are what matter (tools/device/serve_bench.sh).

    PYTHONPATH=. python3 tools/diag/serve_steps.py --out steps.json -- --model smollm2 --draft default --port 8011

Everything after `--` is `eyas serve`'s arguments. On shutdown (SIGINT or SIGTERM) it prints and writes (`--out`)
the steps by kind (decode or prefill) and by the sequences running when each began: count, mean ms a step, the
engine loop thread's CPU time in it (`time.thread_time`: what the wall time has beyond it, the thread spent waiting,
for the GIL, the GPU or a core), mean ms between two steps (a gap longer than `--idle-ms` is idleness, not
counted).
"""
from __future__ import annotations

import argparse
import atexit
import json
import sys
import time
from collections import defaultdict

from eyas.engine.engine import LLMEngine


class StepClock:
    """Wraps `LLMEngine.step` (class-wide: the server builds its engine itself) to time each call by its kind
    (a decode step, or one that prefilled) and the sequences running when it began."""

    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        # steps, their seconds, the loop thread's CPU seconds in them, gaps, the gaps' seconds
        self.rows: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0, 0.0])
        self.last: float | None = None
        self._orig = LLMEngine.step

    def install(self) -> None:
        clock, orig = self, self._orig

        def step(engine):
            batch, decodes = len(engine.scheduler.running), engine.step_counts["decode"]
            t0, c0 = time.perf_counter(), time.thread_time()
            out = orig(engine)
            t1, c1 = time.perf_counter(), time.thread_time()
            row = clock.rows["decode" if engine.step_counts["decode"] > decodes else "prefill", batch]
            row[0] += 1
            row[1] += t1 - t0
            row[2] += c1 - c0
            if clock.last is not None and t0 - clock.last < clock.idle_s:
                row[3] += 1
                row[4] += t0 - clock.last
            clock.last = t1
            return out

        LLMEngine.step = step

    def report(self) -> list[dict]:
        return [{"kind": k, "batch": b, "steps": n, "ms_per_step": 1000 * s / n, "cpu_ms_per_step": 1000 * c / n,
                 "ms_between_steps": 1000 * gs / g if g else None}
                for (k, b), (n, s, c, g, gs) in sorted(self.rows.items()) if n]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the steps' table here (JSON)")
    p.add_argument("--idle-ms", type=float, default=50.0, help="a longer wait between steps is idleness")
    args = p.parse_args(ours)
    clock = StepClock(args.idle_ms / 1000)
    clock.install()

    def report():
        rows = clock.report()
        for r in rows:
            gap = "-" if r["ms_between_steps"] is None else f"{r['ms_between_steps']:.3f}"
            print(f"{r['kind']}, batch {r['batch']}: {r['steps']} steps, {r['ms_per_step']:.3f} ms a step "
                  f"({r['cpu_ms_per_step']:.3f} ms of the loop thread's CPU), {gap} ms between", file=sys.stderr,
                  flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"serve_args": serve, "steps": rows}, f, indent=1)

    atexit.register(report)
    from eyas.serve import api_server
    return api_server.main(serve)


if __name__ == "__main__":
    raise SystemExit(main())
