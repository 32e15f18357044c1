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
counted), and the event loop's (the main thread's: the HTTP handlers, the streamed chunks) CPU time from the end of
one step to the end of the next: what the HTTP side costs a step, in the one GIL the two threads share. Each step
longer than `--slow-ms` is listed with the Triton compiles and CUDA graph captures that ran in it.

With the engine in a process of its own (`--engine-process`, the default on a GPU: decided as `eyas serve` decides it)
it steps in a child process (eyas.serve.engine_core): the steps are timed there, each line of its table begins "engine
process: ", and `--out`'s name with ".engine.json" in place of ".json" holds it (the parent's own table is empty). There
is no event loop beside that engine loop, so that column is "-". Three latencies are reported there too (lines "latency:
..."): a command's, from the parent's put to the child's taking it between two steps ("add" commands); a message's, from
the child's send to the parent's read ("step" and "acks" messages); and the event loop's lag (how late a 1 ms sleep of
the parent's loop wakes), in either mode, so the in-process server's loop is measured the same way. So are the garbage
collector's pauses, by generation, in each process (`EYAS_GC_FREEZE=0` in the environment: without the frozen heap,
eyas.engine.heap), and, for requests from `eyas bench serve` on this machine (its send stamped in a header), each
request's way from the client's send to the server's handler (since session 71). Lines "busy window ..." (since
session 72): each stretch of serving (requests in flight, no more than 1 s apart), with the server process's CPU
and its event loop thread's as shares of one core; the loop thread near 100% means the HTTP side set the pace.
"""
from __future__ import annotations

import argparse
import atexit
import functools
import json
import sys
import threading
import time
from collections import defaultdict

from eyas.engine.engine import LLMEngine


class StepClock:
    """Wraps `LLMEngine.step` (class-wide: the server builds its engine itself) to time each call by its kind
    (a decode step, or one that prefilled) and the sequences running when it began. A step longer than `slow_s` is
    kept whole (`slow`): its kind, batch, ms, and the Triton compiles and CUDA graph captures that ran inside it
    (`events`, filled by `watch_compiles`)."""

    def __init__(self, idle_s: float, slow_s: float = 0.02, event_loop: bool = True):
        self.idle_s, self.slow_s = idle_s, slow_s
        self.events: list[str] = []  # compiles and captures since the current step began
        self.slow: list[dict] = []
        self.steps = 0
        # steps, their seconds, the loop thread's CPU seconds in them, gaps, the gaps' seconds, and the event loop's
        # (the main thread's: the HTTP side) CPU seconds from the end of the step before to the end of this one
        self.rows: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0, 0.0, 0.0])
        self.last: float | None = None
        # the event loop's thread (None in an engine process, whose main thread is the engine loop itself)
        self.main_clock = time.pthread_getcpuclockid(threading.main_thread().ident) if event_loop else None
        self.main_last = 0.0
        self._orig = LLMEngine.step

    def install(self) -> None:
        clock, orig = self, self._orig

        def step(engine):
            batch, decodes = len(engine.scheduler.running), engine.step_counts["decode"]
            clock.events = []
            t0, c0 = time.perf_counter(), time.thread_time()
            out = orig(engine)
            t1, c1 = time.perf_counter(), time.thread_time()
            kind = "decode" if engine.step_counts["decode"] > decodes else "prefill"
            clock.steps += 1
            if t1 - t0 > clock.slow_s:
                clock.slow.append({"step": clock.steps, "kind": kind, "batch": batch, "ms": 1000 * (t1 - t0),
                                   "cpu_ms": 1000 * (c1 - c0), "events": clock.events})
            row = clock.rows[kind, batch]
            row[0] += 1
            row[1] += t1 - t0
            row[2] += c1 - c0
            m1 = time.clock_gettime(clock.main_clock) if clock.main_clock is not None else 0.0
            if clock.last is not None and t0 - clock.last < clock.idle_s:
                row[3] += 1
                row[4] += t0 - clock.last
                row[5] += m1 - clock.main_last
            clock.last, clock.main_last = t1, m1
            return out

        LLMEngine.step = step

    def watch_compiles(self) -> None:
        """Note each Triton JIT compile (kernel and specialisation, ms) and each CUDA graph capture in `events`."""
        clock = self
        try:
            import triton
            knobs = triton.knobs.runtime
            began: dict = {}

            def cache_hook(**kw):
                began[id(kw.get("fn"))] = time.perf_counter()
                return False  # compile as usual

            def post_hook(**kw):
                t = began.pop(id(kw.get("fn")), None)
                ms = "" if t is None else f" {1000 * (time.perf_counter() - t):.0f} ms"
                clock.events.append(f"compile{ms}: {str(kw.get('repr'))[:300]}")

            knobs.jit_cache_hook, knobs.jit_post_compile_hook = cache_hook, post_hook
        except (ImportError, AttributeError):  # no Triton, or one without the knobs
            pass
        try:
            import torch
            begin = torch.cuda.CUDAGraph.capture_begin

            def capture_begin(graph, *a, **kw):
                clock.events.append("CUDA graph capture")
                return begin(graph, *a, **kw)

            torch.cuda.CUDAGraph.capture_begin = capture_begin
        except (ImportError, AttributeError):
            pass

    def report(self) -> list[dict]:
        return [{"kind": k, "batch": b, "steps": n, "ms_per_step": 1000 * s / n, "cpu_ms_per_step": 1000 * c / n,
                 "ms_between_steps": 1000 * gs / g if g else None,
                 "event_loop_cpu_ms_per_step": 1000 * ms / g if g and self.main_clock is not None else None}
                for (k, b), (n, s, c, g, gs, ms) in sorted(self.rows.items()) if n]


class Latencies:
    """Named samples in ms, reported as count, mean, p50, p99 and max."""

    def __init__(self):
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.live = False  # serving has begun (the engine loop started): garbage collections count from here

    def add(self, name: str, seconds: float) -> None:
        self.samples[name].append(1000 * seconds)

    def report(self) -> dict[str, dict]:
        out = {}
        for name, xs in sorted(self.samples.items()):
            xs = sorted(xs)
            out[name] = {"count": len(xs), "mean_ms": sum(xs) / len(xs), "p50_ms": xs[len(xs) // 2],
                         "p99_ms": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "max_ms": xs[-1]}
        return out

    def print(self, who: str = "") -> None:
        for name, r in self.report().items():
            print(f"{who}latency: {name}: {r['count']} samples, mean {r['mean_ms']:.3f} ms, p50 {r['p50_ms']:.3f}, "
                  f"p99 {r['p99_ms']:.3f}, max {r['max_ms']:.3f}", file=sys.stderr, flush=True)


class _StampedQueue:
    """The parent's command queue with each "add" stamped with its put time (`time.monotonic`, one clock for
    both processes); the child's `_take` (`stamp_engine_core`) strips nothing: the engine reads cmd[1] to cmd[3]."""

    def __init__(self, q):
        self._q = q

    def put(self, cmd, *a, **kw):
        if cmd[0] == "add":
            cmd = (*cmd, time.monotonic())
        return self._q.put(cmd, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._q, name)


class _StampedConn:
    """A pipe end whose messages carry their send time last: the child's end appends it (`send`), the parent's strips
    it on `recv` and notes the latency of "step" and "acks" messages."""

    def __init__(self, conn, lat: Latencies | None = None):
        self._c, self._lat = conn, lat

    def send(self, msg):
        return self._c.send((*msg, time.monotonic()) if msg[0] in ("step", "acks") else msg)

    def recv(self):
        msg = self._c.recv()
        if msg[0] in ("step", "acks") and self._lat is not None:
            self._lat.add(f"child's {msg[0]} message, send -> parent's read", time.monotonic() - msg[-1])
            msg = msg[:-1]
        return msg

    def __getattr__(self, name):
        return getattr(self._c, name)


def watch_parent(lat: Latencies, engine_process: bool) -> None:
    """Patch the server's engine loop (`AsyncEngine` or `CoreClient`) to sample its event loop's lag, and, for an
    engine process, to stamp commands and read the stamps of the child's messages."""
    import asyncio
    from eyas.serve.async_engine import AsyncEngine
    from eyas.serve.core_client import CoreClient

    async def lag_probe():
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.001)
            lat.add("event loop lag (a 1 ms sleep's oversleep)", time.monotonic() - t - 0.001)

    def patch(cls):
        orig = cls.start

        def start(self, loop=None):
            if engine_process and isinstance(self, CoreClient) and not isinstance(self.process.commands,
                                                                                   _StampedQueue):
                self.process.commands = _StampedQueue(self.process.commands)
                self.process.conn = _StampedConn(self.process.conn, lat)
            orig(self, loop)
            lat.live = True
            lp = self._loop
            self._lag_task = lp.create_task(lag_probe())

        stop = cls.shutdown

        def shutdown(self, *a, **kw):  # not the lag of shutting down (an engine process's exit: ~1 s)
            task = getattr(self, "_lag_task", None)
            if task is not None:
                task.cancel()
            return stop(self, *a, **kw)

        cls.start, cls.shutdown = start, shutdown

    patch(CoreClient if engine_process else AsyncEngine)


def watch_gc(lat: Latencies) -> None:
    """Note each garbage collection's pause by its generation (`gc.callbacks`) once serving has begun: a full
    collection of a large heap stops the whole process, GIL and all (eyas.engine.heap)."""
    import gc
    began = [0.0]

    def cb(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        elif lat.live:  # not start-up's
            lat.add(f"garbage collection, generation {info['generation']}", time.perf_counter() - began[0])

    gc.callbacks.append(cb)


class BusyWindows:
    """The server process's CPU while it served: a window opens with a request's arrival at the handler when none
    was in flight for `gap_s`, and ends with the last request's end. Each window's wall time, requests, the process's
    CPU (every thread: `time.process_time`) and the event loop thread's (`time.thread_time`, read on that thread)
    as shares of one core: a share near 1 means the HTTP side, not the engine, set the pace."""

    def __init__(self, gap_s: float = 1.0):
        self.gap_s = gap_s
        self.windows: list[dict] = []
        self.inflight = 0

    @staticmethod
    def _now() -> tuple[float, float, float]:
        return time.monotonic(), time.process_time(), time.thread_time()

    def begin(self) -> None:
        now = self._now()
        w = self.windows[-1] if self.windows else None
        if w is None or (self.inflight == 0 and now[0] - w["end"][0] > self.gap_s):
            self.windows.append(w := {"start": now, "end": now, "requests": 0})
        w["requests"] += 1
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1
        self.windows[-1]["end"] = self._now()

    def report(self) -> list[dict]:
        out = []
        for w in self.windows:
            wall, cpu, loop = (e - s for s, e in zip(w["start"], w["end"]))
            if wall > 0:
                out.append({"requests": w["requests"], "seconds": wall, "process_cpu_share": cpu / wall,
                            "event_loop_cpu_share": loop / wall})
        return out

    def print(self, who: str = "") -> None:
        for k, r in enumerate(self.report()):
            if r["requests"] < 2:  # a lone request between runs (a /metrics scrape): the JSON keeps it
                continue
            print(f"{who}busy window {k + 1}: {r['requests']} requests in {r['seconds']:.2f} s, the process's CPU "
                  f"{r['process_cpu_share']:.0%} of a core, its event loop thread's {r['event_loop_cpu_share']:.0%}",
                  file=sys.stderr, flush=True)


def watch_arrivals(lat: Latencies, busy: BusyWindows) -> None:
    """Note how long each request took from the client's send to the server's handler, where the client stamps its
    send (`eyas bench serve`'s `SENT_HEADER`, on the monotonic clock this machine shares): the connection, uvicorn's
    parsing and the event loop's queue before the handler. `busy`: each request's start and end, for its windows."""
    from eyas.bench.serve import SENT_HEADER
    from eyas.serve import api_server
    key = SENT_HEADER.encode()
    create = api_server.create_app

    def create_app(*a, **kw):
        app = create(*a, **kw)

        class Arrivals:
            def __init__(self, inner):
                self.inner = inner

            async def __call__(self, scope, receive, send):
                if scope["type"] != "http" or not lat.live:
                    return await self.inner(scope, receive, send)
                sent = dict(scope["headers"]).get(key)
                if sent is not None:
                    lat.add("client's send -> server's handler", time.monotonic() - float(sent))
                busy.begin()
                try:
                    await self.inner(scope, receive, send)
                finally:
                    busy.end()

        app.add_middleware(Arrivals)
        return app

    api_server.create_app = create_app


def stamp_engine_core(lat: Latencies) -> None:
    """In the child: note each stamped "add" command's latency when the loop takes it."""
    from eyas.serve.engine_core import EngineCore
    orig = EngineCore._take

    def _take(self, block):
        lat.live = True
        cmds = orig(self, block)
        now = time.monotonic()
        for cmd in cmds or ():
            if cmd[0] == "add" and len(cmd) > 4:
                lat.add("parent's add command, put -> child's take", now - cmd[4])
        return cmds

    EngineCore._take = _take


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the steps' table here (JSON)")
    p.add_argument("--idle-ms", type=float, default=50.0, help="a longer wait between steps is idleness")
    p.add_argument("--slow-ms", type=float, default=20.0,
                   help="print each step longer than this, with the compiles and captures inside it")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="the interpreter's GIL switch interval (sys.setswitchinterval; Python's default is 5 ms): how "
                        "long a thread that wants the GIL waits before the one holding it is asked to let go")
    args = p.parse_args(ours)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    clock = StepClock(args.idle_ms / 1000, args.slow_ms / 1000)
    clock.install()
    clock.watch_compiles()
    lat = Latencies()
    from eyas.serve import api_server
    # as `eyas serve` decides it: --engine-process or --no-engine-process, else on where the engine runs on a GPU
    engine_process = api_server.use_engine_process(api_server.parse_serve_args(serve))
    watch_parent(lat, engine_process)
    watch_gc(lat)
    busy = BusyWindows()
    watch_arrivals(lat, busy)
    atexit.register(report, clock, args.out, serve, "", lat, busy)
    if engine_process:  # the engine steps in a child: time it there (`engine_main`), report there
        import eyas.serve.core_client as core_client
        core_client.core_main = functools.partial(engine_main, args.idle_ms / 1000, args.slow_ms / 1000,
                                                  args.out and args.out.removesuffix(".json") + ".engine.json",
                                                  serve)
    return api_server.main(serve)


def report(clock: StepClock, out: str | None, serve: list[str], who: str = "", lat: Latencies | None = None,
           busy: BusyWindows | None = None) -> None:
    """Print the steps' table, the latencies and the busy windows (stderr) and write them to `out` (JSON)."""
    rows = clock.report()
    if lat is not None:
        lat.print(who)
    if busy is not None:
        busy.print(who)
    for r in rows:
        gap, ev = ("-" if r[k] is None else f"{r[k]:.3f}" for k in ("ms_between_steps",
                                                                     "event_loop_cpu_ms_per_step"))
        print(f"{who}{r['kind']}, batch {r['batch']}: {r['steps']} steps, {r['ms_per_step']:.3f} ms a step "
              f"({r['cpu_ms_per_step']:.3f} ms of the loop thread's CPU), {gap} ms between, the event loop's "
              f"CPU {ev} ms a step", file=sys.stderr, flush=True)
    for st in sorted(clock.slow, key=lambda st: -st["ms"])[:40]:  # the longest; all of them in --out
        print(f"{who}slow step {st['step']} ({st['kind']}, batch {st['batch']}): {st['ms']:.1f} ms "
              f"({st['cpu_ms']:.1f} ms CPU)", file=sys.stderr)
        for e in st["events"]:
            print(f"    {e}", file=sys.stderr)
    if out:
        with open(out, "w") as f:
            json.dump({"serve_args": serve, "switch_interval_ms": 1000 * sys.getswitchinterval(), "steps": rows,
                       "latencies": lat.report() if lat is not None else {}, "slow_steps": clock.slow,
                       "busy_windows": busy.report() if busy is not None else []}, f, indent=1)


def engine_main(idle_s: float, slow_s: float, out: str | None, serve: list[str], *args) -> None:
    """An engine process's main (`eyas.serve.engine_core.core_main`) with its steps timed; the table is printed
    (each line "engine process: ...") and written to `out` when its loop ends (a child's atexit does not run)."""
    from eyas.serve.engine_core import core_main
    clock = StepClock(idle_s, slow_s, event_loop=False)
    clock.install()
    clock.watch_compiles()
    lat = Latencies()
    stamp_engine_core(lat)
    watch_gc(lat)
    *rest, conns = args
    try:
        core_main(*rest, [_StampedConn(conns[0]), *conns[1:]])  # the first server's: the one watched here
    finally:
        report(clock, out, serve, "engine process: ", lat)


if __name__ == "__main__":
    raise SystemExit(main())
