"""The parent's half of an engine in a process of its own (`eyas serve --engine-process`; the child's half and the
why: `eyas.serve.engine_core`).

`EngineProcess` starts the child and stands for its engine where the server reads one (`Server`, `create_app`):
the tokenizer, `encode`, `max_model_len`, the model's generation defaults, guided decoding's grammar backend
(made in the parent: a request's guide is checked here before it is queued). With `eyas serve --api-server-count
N`, N HTTP processes share the child: the first holds the `EngineProcess`, each other an `EngineLink` of its own
(`EngineProcess.link_parts`). A link's `make_loop` gives its server a `CoreClient` in place of
`eyas.serve.async_engine.AsyncEngine`, with the same interface (`add`, `abort`, `call`, `results`, `alive`,
`capacity`, `start`, `shutdown`) and the same metrics (`eyas.serve.async_engine.Accounting`).

`CoreClient` lives on the event loop: the child's messages are read when its pipe is readable
(`loop.add_reader`), each output rebuilt as a `RequestOutput` from what it added (`Mirror`) and put on its
request's queue at once. Nothing crosses a thread.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch.multiprocessing as mp

from eyas.engine.detokenizer import OutputText
from eyas.engine.engine import RequestOutput, encode_prompt
from eyas.serve.async_engine import (Accounting, AsyncEngine, EngineDead, EngineError, _Tracker, check_capacity,
                                     check_loop_args, dispatch)
from eyas.serve.engine_core import EngineInfo, core_main
from eyas.serve.metrics import Metrics
from eyas.spec.grammar import LazyGrammarBackend

log = logging.getLogger("eyas.serve")

READ_BATCH = 16  # the child's messages handled at most on one wake-up of the event loop
START_TIMEOUT_S = 3600.0  # loading the model and capturing its graphs in the child (a fresh GPU's compiles too)


class EngineLink:
    """One HTTP process's handle on the engine process: client `client` of its loop (`eyas.serve.engine_core`), with
    the commands queue they share and a pipe of its own. It stands for the engine where the server reads one
    (`Server`, `create_app`): the tokenizer, `encode`, `max_model_len`, the model's generation defaults, guided
    decoding's grammar backend (made here: a request's guide is checked before it is queued). The first server's is
    the `EngineProcess` itself; `eyas serve --api-server-count N` gives each other server one (`link_parts`)."""

    def __init__(self, info: EngineInfo, commands, conn, client: int):
        self.info, self.commands, self.conn, self.client = info, commands, conn, client
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.target = SimpleNamespace(config=SimpleNamespace(vocab_size=info.vocab_size,
                                                             generation_defaults=info.generation_defaults))
        self.tree = SimpleNamespace(name=info.tree_name, max_depth=info.spec_depth)
        self.draft = True if info.has_draft else None
        self._grammar = LazyGrammarBackend(info.tokenizer, info.vocab_size, info.eos_ids)

    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, self.info.vocab_size, prompt)

    def grammar_backend(self):
        """Guided decoding's view of the tokenizer, made once (`LLMEngine.grammar_backend`'s twin: the parent checks
        a guide here, the child compiles it again for its engine)."""
        return self._grammar.get()

    def make_loop(self, metrics: Metrics | None, max_queue: int, stream_interval: int = 1) -> CoreClient:
        """The server's engine loop (what `AsyncEngine` is for an engine of this process)."""
        return CoreClient(self, metrics, max_queue, stream_interval)

    def is_alive(self) -> bool:
        """Whether the engine process runs; another server's link learns its end from its pipe (EOF)."""
        return True

    @property
    def exitcode(self) -> int | None:
        return None

    def close(self, timeout: float = 10.0) -> None:
        """Leave the engine: its requests from this server are aborted ("detach"), the engine goes on. The queue
        stays open (the process's exit flushes what it holds): other links of this process may share it."""
        try:
            self.commands.put(("detach", self.client))
        except (OSError, ValueError):
            pass
        self.conn.close()


class EngineProcess(EngineLink):
    """An engine built and stepped in a child process, and the first server's link to it (client 0).
    `llm_kwargs`: what `eyas.LLM` takes; `prepare`: a module-level function the child calls on its engine before it
    is ready (pickled by name; e.g. capturing the CUDA graphs), or None; `clients`: the HTTP processes that will
    share it (`link_parts(i)` makes client i's link in its process). Raises RuntimeError, with the child's
    traceback, when the engine cannot be built."""

    def __init__(self, llm_kwargs: dict, prepare=None, log_level: str = "info",
                 start_timeout: float = START_TIMEOUT_S, clients: int = 1):
        for key in ("disaggregate", "prefill_process"):
            if llm_kwargs.get(key):
                raise ValueError(f"an engine in a process of its own does not combine with {key} yet")
        if clients < 1:
            raise ValueError(f"an engine process needs at least one client, got {clients}")
        # run first by `close` (once): `eyas serve --api-server-count` stops the other servers there, so that none
        # loses the engine while it still serves
        self.on_close: list = []
        ctx = mp.get_context("spawn")
        commands = ctx.Queue()
        pipes = [ctx.Pipe(duplex=False) for _ in range(clients)]
        self.proc = ctx.Process(target=core_main, args=(llm_kwargs, prepare, log_level, commands,
                                                        [w for _, w in pipes]),
                                name="eyas-engine", daemon=True)
        self.proc.start()
        for _, w in pipes:  # the child's ends: once the child is gone, reads here meet EOF
            w.close()
        conn = pipes[0][0]
        self._others = [r for r, _ in pipes[1:]]  # the other clients' ends, until their processes take them
        self.commands, self.conn = commands, conn  # what `close` needs, should the start fail
        deadline = time.monotonic() + start_timeout
        while not conn.poll(1.0):
            if not self.proc.is_alive():
                self.close()
                raise RuntimeError(f"the engine process died while starting (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the engine process was not ready in {start_timeout:.0f} s")
        try:
            msg = conn.recv()
        except EOFError:
            msg = ("start failed", f"the engine process died while starting (exit code {self.proc.exitcode})")
        if msg[0] != "ready":
            self.close()
            raise RuntimeError(f"the engine process failed to start:\n{msg[1]}")
        super().__init__(msg[1], commands, conn, 0)

    def link_parts(self, client: int) -> tuple:
        """What client `client` (1..clients - 1) needs for its `EngineLink(*parts)`, to hand to its process."""
        if not 1 <= client <= len(self._others):
            raise ValueError(f"client must be in 1..{len(self._others)}, got {client}")
        return self.info, self.commands, self._others[client - 1], client

    def close_links(self) -> None:
        """Close this process's copies of the other clients' pipe ends, once their processes hold theirs: the engine
        then meets a broken pipe when such a process dies, and drops its requests."""
        for c in self._others:
            c.close()

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child (the "stop" command first, then SIGTERM, then SIGKILL)."""
        while self.on_close:
            self.on_close.pop()()
        if self.proc.is_alive():
            try:
                self.commands.put(("stop",))
            except (OSError, ValueError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.commands.close()
        self.commands.join_thread()
        self.conn.close()
        for c in self._others:
            c.close()


class Mirror:
    """The parent's copy of one request's output, grown by the child's messages (`EngineCore.encode_output`), from
    which each step's `RequestOutput` is built with the reads of the child's: token ids (the prompt's stand as
    zeros: only the output is read), the text's pieces, the logprobs."""

    __slots__ = ("ids", "pieces", "logprobs", "prompt_logprobs")

    def __init__(self):
        self.ids: list[int] | None = None
        self.pieces: list[str] = []
        self.logprobs: list | None = None
        self.prompt_logprobs = None

    def update(self, msg: tuple) -> RequestOutput:
        (rid, new_ids, ids, finished, reason, num_prompt, cached, stats, start, pieces, count, stable_len, pending,
         length, lps, plp) = msg
        if self.ids is None:
            self.ids = [0] * num_prompt
        self.ids += ids
        del self.pieces[start:]
        self.pieces += pieces
        if lps is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += lps
        if plp is not None:
            self.prompt_logprobs = plp
        return RequestOutput(rid, new_ids, finished, reason, num_prompt, stats, self.ids,
                             OutputText(self.pieces, count, stable_len, pending, length), cached, self.logprobs,
                             self.prompt_logprobs)


@dataclass
class _Pending:
    """An add or a call sent and not yet answered."""
    future: asyncio.Future
    items: list | None = None  # an add's (request id, prompt, params)
    queue: asyncio.Queue | None = None
    arrival: float = 0.0
    cancelled: bool = False  # the add's caller gave up: its requests are aborted once the add is answered


class CoreClient:
    """`AsyncEngine`'s interface over an `EngineLink` (see the module's docstring). Every method but `abort`
    runs on the event loop; `abort` is safe from any thread."""

    results = staticmethod(AsyncEngine.results)

    def __init__(self, process: EngineLink, metrics: Metrics | None = None, max_queue: int = 256,
                 stream_interval: int = 1):
        check_loop_args(max_queue, stream_interval)
        self.stream_interval = stream_interval  # `dispatch`'s interval
        info = process.info
        self.process, self.metrics, self.max_queue = process, metrics, max_queue
        self.accounting = Accounting(metrics, *info.counts, tree_depths=info.tree_depths, spec_depth=info.spec_depth,
                                     kv_total=info.kv_total)
        self._tags = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._trackers: dict[str, _Tracker] = {}
        self._mirrors: dict[str, Mirror] = {}
        self._in_flight = 0
        self._handed_in = 0  # requests in adds not yet answered (the waiting gauge counts them)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        # the engine's counts as this server heard of them: it adds up the moves each message carries (with several
        # servers, each hears of a part; `eyas.serve.metrics` sums them over the processes)
        self._counts = [dict(info.counts[0]), dict(info.counts[1]), info.counts[2]]
        self.accounting.set_gauges(0, 0, 0)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._loop is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._loop.add_reader(self.process.conn.fileno(), self._readable)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child (a link of another server: leave it): the requests it holds for this server are
        aborted."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.process.conn.fileno())
        for tr_id in list(self._trackers):
            self._drop(tr_id, "abort")
        self.process.close(timeout)
        self._dead = self._dead or "the engine process was stopped"

    @property
    def alive(self) -> bool:
        return self._loop is not None and self._dead is None and self.process.is_alive()

    @property
    def capacity(self) -> int:
        return self.process.info.max_num_seqs + self.max_queue

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    # ---- the handlers' side ---------------------------------------------------------------------------------
    async def add(self, items: list, arrival: float | None = None) -> asyncio.Queue:
        """As `AsyncEngine.add`."""
        if not self.alive:
            raise EngineDead(self._dead or "the engine process is not running")
        check_capacity(self._in_flight, len(items), self.capacity)
        self._in_flight += len(items)
        self._handed_in += len(items)
        tag = next(self._tags)
        p = self._pending[tag] = _Pending(self._loop.create_future(), items, asyncio.Queue(),
                                          arrival or time.perf_counter())
        self.process.commands.put(("add", self.process.client, tag, items))
        try:
            await p.future
        except asyncio.CancelledError:  # the client went away while we waited: its requests go once added
            p.cancelled = True
            raise
        return p.queue

    async def call(self, fn):
        """`fn(engine)` in the child between two steps; its result. `fn` must be picklable (a module-level
        function)."""
        if not self.alive:
            raise EngineDead(self._dead or "the engine process is not running")
        tag = next(self._tags)
        p = self._pending[tag] = _Pending(self._loop.create_future())
        self.process.commands.put(("call", self.process.client, tag, fn))
        return await p.future

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ones are ignored)."""
        if not request_ids:
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:
                loop.call_soon_threadsafe(self.abort, request_ids)
                return
        for rid in request_ids:
            self._drop(rid, "abort")
        if self._dead is None:
            self.process.commands.put(("abort", self.process.client, list(request_ids)))

    def _drop(self, rid: str, reason: str) -> None:
        tr = self._trackers.pop(rid, None)
        self._mirrors.pop(rid, None)
        if tr is not None:
            self._release(1)
            self.accounting.finished(reason)

    def _release(self, n: int) -> None:
        self._in_flight -= n

    # ---- the child's messages -------------------------------------------------------------------------------
    def _readable(self) -> None:
        """The child's waiting messages, at most `READ_BATCH` (the reader fires again while more wait): the handlers
        get the loop between batches however fast the child steps."""
        conn = self.process.conn
        try:
            for _ in range(READ_BATCH):
                if not conn.poll():
                    break
                self._handle(conn.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(conn.fileno())
            code = self.process.exitcode  # unknown to another server's link
            self._die("the engine process exited" + ("" if code is None else f" (exit code {code})"))

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            self._outputs(msg[1])
        elif kind == "acks":
            for tag, err, result in msg[1]:
                self._ack(tag, err, result)
        elif kind == "failed":  # a step raised: the child aborted every request it held
            self._fail_all(EngineError(f"the engine failed while serving this request: {msg[1]}"))
        elif kind == "dead":
            self._die(f"the engine loop stopped:\n{msg[1]}")
            return
        elif kind == "stopped":
            return
        if len(msg) > 2:
            running, waiting, used, steps, trees, preempted = msg[-1]
            if steps or trees or preempted:  # the counts' moves since the engine's last message (to any server)
                c = self._counts
                for k, d in steps.items():
                    c[0][k] = c[0].get(k, 0) + d
                for k, d in trees.items():
                    c[1][k] = c[1].get(k, 0) + d
                c[2] += preempted
                self.accounting.count_steps(*c)
            self.accounting.set_gauges(running, waiting + self._handed_in, used)

    def _outputs(self, msgs: list[tuple]) -> None:
        outs = []
        for m in msgs:
            mirror = self._mirrors.get(m[0])
            if mirror is None:  # aborted here since
                continue
            outs.append(mirror.update(m))
            if m[3]:  # finished
                del self._mirrors[m[0]]
        for q, item in dispatch(self._trackers, outs, self.accounting, self._release, self.stream_interval):
            q.put_nowait(item)

    def _ack(self, tag: int, err: tuple | None, result) -> None:
        p = self._pending.pop(tag, None)
        if p is None:
            return
        if p.items is not None:  # an add
            self._handed_in -= len(p.items)
            if err is None and p.cancelled:  # added after its caller left: gone again
                self.process.commands.put(("abort", self.process.client, [rid for rid, _, _ in p.items]))
                self._release(len(p.items))
                self.accounting.finished("abort", len(p.items))
                return
            if err is not None:
                self._release(len(p.items))
            else:
                for i, (rid, _, _) in enumerate(p.items):
                    self._trackers[rid] = _Tracker(p.queue, i, p.arrival)
                    self._mirrors[rid] = Mirror()
        if not p.future.done():
            if err is None:
                p.future.set_result(result)
            else:
                p.future.set_exception(ValueError(err[1]) if err[0] == "ValueError"
                                       else EngineError(f"the engine could not take this: {err[1]}"))

    def _fail_all(self, exc: BaseException) -> None:
        for rid, tr in list(self._trackers.items()):
            tr.queue.put_nowait(exc)
            self._drop(rid, "error")

    def _die(self, why: str) -> None:
        if self._dead is not None:
            return
        self._dead = why
        log.critical("%s", why)
        self._fail_all(EngineError(f"the engine process stopped while serving this request: {why}"))
        for p in self._pending.values():
            if not p.future.done():
                p.future.set_exception(EngineDead(why))
            if p.items is not None:
                self._release(len(p.items))
                self._handed_in -= len(p.items)
        self._pending.clear()
