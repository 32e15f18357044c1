"""The engine loop: one thread owns the (not thread-safe) `LLMEngine` and steps it while there is work.

The asyncio side (the HTTP handlers) never touches the engine. It hands commands in through `_inbox` (a list under
a condition variable: add a group of requests, abort requests), and gets outputs back on a per-request
`asyncio.Queue`, filled from the loop thread with `loop.call_soon_threadsafe` (one call per engine step).

Between two engine steps the loop thread drains the inbox, so new requests join the running batch at the next step
(continuous batching) and aborted ones leave it, their KV blocks freed at once.

Admission is bounded: at most `max_num_seqs + max_queue` requests live in the engine (the running batch plus a
waiting queue of `max_queue`); beyond that `add` raises `QueueFull` and the server answers 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field

from eyas.engine.engine import LLMEngine, RequestOutput
from eyas.sampling_params import SamplingParams
from eyas.serve.metrics import Metrics

log = logging.getLogger("eyas.serve")


class QueueFull(Exception):
    """The engine holds as many requests as it may; try again later."""


class EngineDead(RuntimeError):
    """The engine loop is not running."""


class EngineError(RuntimeError):
    """An engine step failed; the requests in it were aborted."""


@dataclass
class _Tracker:
    """Loop-thread-side state of one live request (one choice)."""
    queue: asyncio.Queue
    index: int  # the choice index within its HTTP request
    arrival: float
    first: float | None = None
    last: float | None = None
    calls: int = 0
    committed: int = 0
    accepted: list[int] = field(default_factory=list)
    held: RequestOutput | None = None  # outputs kept back by a stream interval, not yet delivered (`dispatch`)
    delivered: int = 0  # its output tokens as of its last delivered output


def _grown(xs: list[int], n: int) -> list[int]:
    """`xs`, zero-padded in place to at least n entries."""
    if len(xs) < n:
        xs += [0] * (n - len(xs))
    return xs


@dataclass
class _StepCounts:
    """What one engine step adds to the counters, summed over its requests and published once (`publish`): an
    increment of a prometheus-client counter takes ~0.4 us under a lock, and there were several per request."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    calls: int = 0
    committed: int = 0
    accepted: list[int] = field(default_factory=list)  # [d]: verify calls whose accepted path reached depth d+1

    def publish(self, m: Metrics) -> None:
        if self.prompt_tokens:
            m.prompt_tokens.inc(self.prompt_tokens)
        if self.generation_tokens:
            m.generation_tokens.inc(self.generation_tokens)
        m.add_spec(self.calls, self.committed)
        for d, v in enumerate(self.accepted):
            if v > 0:
                m.accepted(d + 1).inc(v)


@dataclass
class _Add:
    items: list[tuple[str, list[int] | str, SamplingParams]]  # (request id, prompt, params), one per choice
    queue: asyncio.Queue
    future: asyncio.Future
    arrival: float


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: object  # engine -> result, run on the loop thread between two steps
    future: asyncio.Future


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None, max_queue: int = 256,
                 stream_interval: int = 1):
        check_loop_args(max_queue, stream_interval)
        self.stream_interval = stream_interval  # `dispatch`'s interval
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._cv = threading.Condition()
        self._inbox: list = []
        self._lock = threading.Lock()  # guards _in_flight
        self._in_flight = 0  # requests handed in and not yet finished or aborted
        self._trackers: dict[str, _Tracker] = {}  # loop thread only
        self._outbox: list = []  # loop thread only: callbacks for the event loop, posted by _publish
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._dead: str | None = None
        self.accounting = Accounting(metrics, *engine_counts(engine), tree_depths=tree_depths(engine),
                                     spec_depth=engine.tree.max_depth if engine.draft is not None else 0,
                                     kv_total=engine.blocks.num_usable)
        self._update_gauges()

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the loop thread; outputs are delivered on `loop` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="eyas-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def capacity(self) -> int:
        return self.engine.scheduler.max_num_seqs + self.max_queue

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    # ---- the asyncio side -----------------------------------------------------------------------------------
    async def add(self, items: list[tuple[str, list[int] | str, SamplingParams]],
                  arrival: float | None = None) -> asyncio.Queue:
        """Hand in a group of requests (the choices of one HTTP request), all or none. Returns the queue on which
        `(choice index, RequestOutput)` items arrive (or an `EngineError`). Raises QueueFull, EngineDead, or the
        engine's ValueError for bad input (nothing is left behind then)."""
        if not self.alive:
            raise EngineDead(self._dead or "the engine loop is not running")
        with self._lock:
            check_capacity(self._in_flight, len(items), self.capacity)
            self._in_flight += len(items)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()
        self._submit(_Add(items, queue, fut, arrival or time.perf_counter()))
        try:
            await fut
        except asyncio.CancelledError:  # the client went away while we waited: undo (the add comes first)
            self.abort([rid for rid, _, _ in items])
            raise
        return queue

    async def call(self, fn):
        """`fn(engine)` on the loop thread between two steps (the engine is not thread-safe); its result."""
        if not self.alive:
            raise EngineDead(self._dead or "the engine loop is not running")
        fut = asyncio.get_running_loop().create_future()
        self._submit(_Call(fn, fut))
        return await fut

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ones are ignored). Safe from any thread."""
        if request_ids:
            self._submit(_Abort(list(request_ids)))

    def _submit(self, cmd) -> None:
        with self._cv:
            self._inbox.append(cmd)
            self._cv.notify()

    @staticmethod
    async def results(queue: asyncio.Queue, n: int):
        """Yield (index, RequestOutput) until all `n` choices have finished; raises an EngineError item.

        A consumer that fell behind (the event loop busy with other streams while the engine stepped on) finds
        several steps' outputs waiting: each choice's come as one (`RequestOutput.after`), so a lagging stream sends
        one chunk for them, not one each, and catches up (vLLM's output collector merges so too). Each choice's
        outputs keep their order; an error comes after the outputs before it."""
        done = 0
        while done < n:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            merged: dict[int, RequestOutput] = {}
            error = None
            for item in items:
                if isinstance(item, BaseException):
                    error = item
                    break
                i, out = item
                merged[i] = out if i not in merged else out.after(merged[i])
            for i, out in merged.items():
                yield i, out
                if out.finished:
                    done += 1
            if error is not None:
                raise error

    # ---- the loop thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        """Each iteration: take the commands, publish (gauges, then acks), step, publish (gauges, then outputs).
        Gauges are set before the clients hear anything, so a scrape after a reply sees at least that state."""
        eng = self.engine
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self._stopping and not eng.has_unfinished():
                        self._cv.wait(timeout=1.0)
                    cmds, self._inbox = self._inbox, []
                    stopping = self._stopping
                for cmd in cmds:
                    if isinstance(cmd, _Add):
                        self._handle_add(cmd)
                    elif isinstance(cmd, _Call):
                        self._handle_call(cmd)
                    else:
                        self._handle_abort(cmd.request_ids, "abort")
                if stopping:
                    self._handle_abort(list(self._trackers), "abort")
                if cmds or stopping:
                    self._publish()
                if stopping:
                    break
                if eng.has_unfinished():
                    try:
                        outs = eng.step()
                    except Exception as e:  # never kill the loop: fail the requests of this batch, go on
                        log.error("engine step failed:\n%s", traceback.format_exc())
                        self._fail_all(e)
                        outs = []
                    self._dispatch(outs)
                    self._publish()
        except BaseException as e:  # a bug in the loop itself: say so on /health and to every waiting client
            self._dead = f"the engine loop stopped: {e!r}"
            log.critical("engine loop died:\n%s", traceback.format_exc())
            self._fail_all(e)
            self._publish()

    def _publish(self) -> None:
        """Update the gauges, then run the callbacks gathered for the event loop (acks, outputs) in one call."""
        self._update_gauges()
        fns, self._outbox = self._outbox, []
        if not fns or self._loop is None:
            return

        def run():
            for fn in fns:
                fn()

        try:
            self._loop.call_soon_threadsafe(run)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def _deliver(self, deliveries: list[tuple[asyncio.Queue, object]]) -> None:
        if deliveries:
            self._outbox.append(lambda: [q.put_nowait(item) for q, item in deliveries])

    def _resolve(self, fut: asyncio.Future, exc: BaseException | None, result=None) -> None:
        def set_():
            if not fut.done():
                if exc is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(exc)

        self._outbox.append(set_)

    def _release(self, n: int) -> None:
        with self._lock:
            self._in_flight -= n

    def _handle_add(self, cmd: _Add) -> None:
        eng, added = self.engine, []
        try:
            for rid, prompt, params in cmd.items:
                eng.add_request(prompt, params, request_id=rid)
                added.append(rid)
        except Exception as e:
            for rid in added:
                eng.abort(rid)
            self._release(len(cmd.items))
            self._resolve(cmd.future, e if isinstance(e, ValueError) else EngineError(f"could not add: {e!r}"))
            return
        for i, (rid, _, _) in enumerate(cmd.items):
            self._trackers[rid] = _Tracker(cmd.queue, i, cmd.arrival)
        self._resolve(cmd.future, None)

    def _handle_call(self, cmd: _Call) -> None:
        try:
            result, exc = cmd.fn(self.engine), None
        except Exception as e:  # noqa: BLE001 - the caller's to report
            result, exc = None, e
        self._resolve(cmd.future, exc, result)

    def _handle_abort(self, request_ids: list[str], reason: str) -> None:
        for rid in request_ids:
            tr = self._trackers.pop(rid, None)
            if tr is None:
                continue
            self.engine.abort(rid)
            self._release(1)
            self.accounting.finished(reason)

    def _fail_all(self, e: BaseException) -> None:
        err = EngineError(f"the engine failed while serving this request: {e!r}")
        deliveries = []
        for rid, tr in list(self._trackers.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                pass
            deliveries.append((tr.queue, err))
            self._trackers.pop(rid, None)
            self._release(1)
            self.accounting.finished("error")
        self._deliver(deliveries)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        self._deliver(dispatch(self._trackers, outs, self.accounting, self._release, self.stream_interval))
        if self.metrics is not None:  # the counts are read for the metrics only
            self.accounting.count_steps(*engine_counts(self.engine))

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        eng = self.engine
        with self._cv:
            handed_in = sum(len(c.items) for c in self._inbox if isinstance(c, _Add))
        self.accounting.set_gauges(len(eng.scheduler.running), len(eng.scheduler.waiting) + handed_in,
                                   eng.blocks.num_used)


# ---- what both engine loops share: admission, the trackers' dispatch and the metrics ------------------------------

def check_loop_args(max_queue: int, stream_interval: int) -> None:
    """ValueError unless max_queue >= 0 and stream_interval >= 1."""
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    if stream_interval < 1:
        raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")


def check_capacity(in_flight: int, n: int, capacity: int) -> None:
    """QueueFull unless `n` more requests fit beside the `in_flight` ones (at most `capacity`)."""
    if in_flight + n > capacity:
        raise QueueFull(f"the server is at capacity ({in_flight} requests in flight, at most {capacity}); retry later")


def tree_depths(engine) -> dict[str, int]:
    """Each tree a decode step can take, by name, and its draft levels (a metric label and its draft forwards)."""
    depths = {t.name: t.max_depth for t in getattr(engine.tree, "all_trees", [engine.tree])}
    bare = getattr(getattr(engine, "runner", None), "bare_tree", None)
    if bare is not None:  # plain steps of requests that never speculate: no draft forward
        depths[bare.name] = 0
    return depths


def engine_counts(engine) -> tuple[dict[str, int], dict[str, int], int]:
    """The engine's running counts the metrics follow: steps by kind, decode steps by tree, preemptions."""
    trees = getattr(getattr(engine, "runner", None), "tree_steps", None) or {}
    return dict(engine.step_counts), dict(trees), engine.scheduler.num_preemptions


def dispatch(trackers: dict[str, _Tracker], outs: list[RequestOutput], accounting: Accounting,
             release, interval: int = 1) -> list[tuple[asyncio.Queue, object]]:
    """One step's outputs to their requests' queues (returned as (queue, item) pairs to put), each accounted for
    in the metrics (where `accounting` has them); a finished request's tracker is dropped and `release(1)`
    called.

    `interval` (`eyas serve --stream-interval`, SGLang's and vLLM's option of that name): a request's outputs are
    delivered once `interval` tokens have come since its last delivery, the first output (TTFT) and the last at
    once; the ones kept back are folded into the next (`RequestOutput.after`), so a stream sends a chunk per
    `interval` tokens, not per step. The metrics still count every step's tokens when the engine made them."""
    now = time.perf_counter()
    deliveries = []
    step = _StepCounts() if accounting.metrics is not None else None
    for out in outs:
        tr = trackers.get(out.request_id)
        if tr is None:
            continue
        if step is not None:
            accounting.account(tr, out, now, step)
        if interval > 1:
            if tr.held is not None:
                out, tr.held = out.after(tr.held), None
            if not out.finished and tr.delivered and out.num_output_tokens - tr.delivered < interval:
                tr.held = out
                continue
            tr.delivered = out.num_output_tokens
        deliveries.append((tr.queue, (tr.index, out)))
        if out.finished:
            del trackers[out.request_id]
            release(1)
    if step is not None:
        step.publish(accounting.metrics)
    return deliveries


class Accounting:
    """The metrics of an engine loop (`eyas.serve.metrics`): each request's latencies and counts as its outputs
    arrive (`account`), the engine's step counts as they move (`count_steps`), the gauges (`set_gauges`), and
    the requests that end without an output (`finished`). Without `metrics` it counts nothing.
    `steps`, `trees` and `preempted`: the engine's counts when the loop began (`engine_counts`); `tree_depths`:
    the trees' draft levels (`tree_depths`); `spec_depth`: the deepest tree's, 0 without a draft."""

    def __init__(self, metrics: Metrics | None, steps: dict[str, int], trees: dict[str, int], preempted: int,
                 tree_depths: dict[str, int], spec_depth: int, kv_total: int):
        self.metrics = metrics
        self._steps_seen, self._trees_seen, self._preempted_seen = dict(steps), dict(trees), preempted
        self._tree_depths, self.spec_depth, self.kv_total = tree_depths, spec_depth, kv_total
        if metrics is not None:
            metrics.set_tree_depth(spec_depth)
            if spec_depth:  # every tree a step can take, at 0 from the start
                for name in tree_depths:
                    metrics.tree_steps(name)
            metrics.kv_total.set(kv_total)

    def count_steps(self, counts: dict[str, int], trees: dict[str, int], preempted: int) -> None:
        m = self.metrics
        if m is None:
            return
        for kind in ("prefill", "decode"):
            d = counts[kind] - self._steps_seen.get(kind, 0)
            if d > 0:
                m.steps[kind].inc(d)
                if kind == "decode" and self.spec_depth:
                    m.verify_steps.inc(d)
                    if not trees:  # no per-tree counts (a disaggregated engine): the deepest tree's
                        m.draft_forwards.inc(d * self.spec_depth)
        self._steps_seen = dict(counts)
        for name, n in trees.items():  # decode steps by tree, and each tree's draft levels
            d = n - self._trees_seen.get(name, 0)
            if d > 0:
                m.tree_steps(name).inc(d)
                if self.spec_depth:
                    m.draft_forwards.inc(d * self._tree_depths.get(name, self.spec_depth))
        self._trees_seen = dict(trees)
        if preempted > self._preempted_seen:
            m.preemptions.inc(preempted - self._preempted_seen)
            self._preempted_seen = preempted

    def set_gauges(self, running: int, waiting: int, used: int) -> None:
        m = self.metrics
        if m is None:
            return
        m.running.set(running)
        m.waiting.set(waiting)
        m.kv_used.set(used)
        m.kv_usage.set(used / self.kv_total if self.kv_total else 0.0)

    def finished(self, reason: str, n: int = 1) -> None:
        """`n` requests ended without a last output: aborted ("abort") or failed ("error")."""
        if self.metrics is not None:
            self.metrics.finished(reason).inc(n)

    def account(self, tr: _Tracker, out: RequestOutput, now: float, step: _StepCounts) -> None:
        """One request's part of this step in the metrics: its latencies at once, its counts added to `step`'s
        (published once a step)."""
        m = self.metrics
        k = len(out.new_token_ids)
        if k:
            if tr.first is None:
                tr.first = now
                m.ttft.observe(now - tr.arrival)
                step.prompt_tokens += out.num_prompt_tokens
                m.prefix_queries.inc(out.num_prompt_tokens)
                m.prefix_hits.inc(out.num_cached_tokens)
            else:
                m.ttit.observe((now - tr.last) / k, k)
            tr.last = now
            step.generation_tokens += k
        st = out.stats
        step.calls += st.target_calls - tr.calls
        step.committed += st.committed - tr.committed
        tr.calls, tr.committed = st.target_calls, st.committed
        by_depth = st.accepted_by_depth
        seen, acc = _grown(tr.accepted, len(by_depth)), _grown(step.accepted, len(by_depth))
        for d, v in enumerate(by_depth):
            if v != seen[d]:
                acc[d] += v - seen[d]
                seen[d] = v
        if out.finished:
            m.e2e.observe(now - tr.arrival)
            m.req_prompt_tokens.observe(out.num_prompt_tokens)
            m.req_gen_tokens.observe(out.num_output_tokens)
            if st.target_calls:
                m.req_tpc.observe(st.tokens_per_call)
            m.finished(out.finish_reason or "stop").inc()
