"""The engine loop in a process of its own (`eyas serve --engine-process`; vLLM V1's "engine core").

In one process, the HTTP side (the event loop: the handlers, every streamed chunk) and the engine loop's thread
(`eyas.serve.async_engine`) share one interpreter and its GIL. On a GPU a small model's step is mostly the host's
work, so at 64 streams the HTTP side's CPU lengthens every step: session 68 measured 0.6-2.4 ms of the event loop's
CPU a step beside decode steps of 2.7-4.8 ms, which took 1.55 ms with no server around them (an H100, SmolLM2).
Here the engine and its loop live in a child process (spawned: CUDA cannot be forked), the HTTP side in the parent;
`eyas.serve.core_client` is the parent's half.

* The parent sends commands on a `multiprocessing` queue (its feeder thread pickles and writes them, so the event
  loop never blocks on a full pipe): ("add", client, tag, [(request id, prompt, params), ...]), ("abort", client,
  [request ids]), ("call", client, tag, fn) (`fn(engine)`, a module-level function, pickled by name), ("detach",
  client), ("stop",).
* Several HTTP processes can share the engine (`eyas serve --api-server-count N`): they write to the one queue, and
  each reads its own pipe, client i the i-th. A request's outputs go to the client that added it, and an add's or a
  call's answer to the client that sent it; a step with no outputs at all goes to client 0 (for its counts). A
  client that detaches, or whose pipe breaks, loses its requests (aborted, their blocks freed); the loop goes on for
  the others.
* Between two steps the child takes every command waiting, answers a client's adds and calls in one "acks" message
  (with none to answer, its aborts get one too: the state after them), steps the engine, and sends the step's
  outputs in one "step" message a client, which the parent's event loop reads when its pipe is readable. Each
  output goes as what it added since the last (`encode_output`): the new token ids, the text's new final pieces and
  its pending tail, the new logprobs. The parent rebuilds a `RequestOutput` with the same reads
  (`eyas.serve.core_client.Mirror`).
* Each message carries the engine's state for the metrics (`EngineCore.state`): its running and waiting requests,
  the KV blocks in use, and how far its step counts moved since the last message to any client. The metrics live in
  the HTTP processes, which serve /metrics; summed over them, the moves give the engine's counts.
* A step that raises aborts every request the engine holds and says so ("failed", to every client); the loop goes
  on. The child ends on "stop", when its parent is gone, or when client 0's pipe breaks.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import signal
import traceback
from dataclasses import dataclass

from eyas.engine.heap import freeze_heap

log = logging.getLogger("eyas.serve")

IDLE_POLL_S = 1.0  # an idle child wakes this often to see whether its parent is still there


@dataclass
class EngineInfo:
    """What the parent needs of the engine, sent once it is built: the tokenizer (the chat template, prompts'
    token ids, guided decoding's vocabulary) and the engine's settings."""
    tokenizer: object
    vocab_size: int
    max_model_len: int
    generation_defaults: dict | None
    eos_ids: list[int]
    tree_name: str
    has_draft: bool
    spec_depth: int  # the deepest tree's draft levels, 0 without a draft
    tree_depths: dict[str, int]  # each tree a step can take, and its draft levels
    kv_total: int  # KV blocks usable
    max_num_seqs: int
    counts: tuple  # `eyas.serve.async_engine.engine_counts` when the loop began


def error_of(e: BaseException) -> tuple[str, str]:
    """An exception as the parent raises it again: ("ValueError", message) for bad input (a 400), else ("error",
    its repr)."""
    return ("ValueError", str(e)) if isinstance(e, ValueError) else ("error", repr(e))


class EngineCore:
    """The child's loop over one `LLMEngine` (see the module's docstring). `conns`: a pipe per client (one per HTTP
    process)."""

    def __init__(self, engine, commands, conns: list):
        self.engine, self.commands, self.conns = engine, commands, list(conns)
        # per live request: output tokens, text pieces and logprobs sent so far, and whether its prompt's logprobs
        # went whole
        self.sent: dict[str, list] = {}
        self.owner: dict[str, int] = {}  # per live request: the client that added it
        self.gone: set[int] = set()  # clients detached, or whose pipe broke
        self.parent = mp.parent_process()
        from eyas.serve.async_engine import engine_counts
        self._counts = engine_counts  # (steps by kind, decode steps by tree, preemptions)
        self.reported = engine_counts(engine)  # the counts as the clients have heard of them (`EngineInfo.counts`)

    def state(self) -> tuple:
        """(running, waiting, KV blocks used, steps by kind, decode steps by tree, preemptions): the metrics' reads,
        each count as what it moved since the last message (`eyas.serve.core_client.CoreClient` adds them up)."""
        eng, (steps, trees, preempted) = self.engine, self.reported
        now = self._counts(eng)
        self.reported = now
        sch = eng.scheduler
        return (len(sch.running), len(sch.waiting), eng.blocks.num_used,
                {k: v - steps.get(k, 0) for k, v in now[0].items() if v != steps.get(k, 0)},
                {k: v - trees.get(k, 0) for k, v in now[1].items() if v != trees.get(k, 0)}, now[2] - preempted)

    def run(self) -> None:
        eng = self.engine
        while True:
            cmds = self._take(block=not eng.has_unfinished())
            if cmds is None:  # the parent is gone
                return
            acks: dict[int, list] = {}
            stop = False
            for cmd in cmds:
                kind = cmd[0]
                if kind == "add":
                    acks.setdefault(cmd[1], []).append(self._add(cmd[1], cmd[2], cmd[3]))
                elif kind == "abort":
                    for rid in cmd[2]:  # unknown or finished ones are ignored
                        self._forget(rid)
                        eng.abort(rid)
                    acks.setdefault(cmd[1], [])
                elif kind == "call":
                    acks.setdefault(cmd[1], []).append(self._call(cmd[2], cmd[3]))
                elif kind == "detach":
                    self._detach(cmd[1])
                elif kind == "stop":
                    stop = True
            if stop:
                self._abort_all()
                self.conns[0].send(("stopped",))
                return
            if acks:  # the answers, and the state after them (aborts free blocks; the gauges see it at once)
                for client, items in acks.items():
                    self._send(client, ("acks", items, self.state()))
            if eng.has_unfinished():
                try:
                    outs = eng.step()
                except Exception as e:  # never kill the loop: fail the requests of this batch, go on
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._abort_all()
                    for client in range(len(self.conns)):
                        self._send(client, ("failed", repr(e), self.state()))
                    continue
                self._send_outputs(outs)

    def _send_outputs(self, outs: list) -> None:
        """A step's outputs, to the clients that added them (a step without any: to client 0, for the counts)."""
        if len(self.conns) == 1 or not outs:
            self._send(0, ("step", [self.encode_output(o) for o in outs], self.state()))
            return
        by_client: dict[int, list] = {}
        owner = self.owner
        for o in outs:
            by_client.setdefault(owner.get(o.request_id, 0), []).append(self.encode_output(o))
        for client, msgs in by_client.items():
            self._send(client, ("step", msgs, self.state()))

    def _send(self, client: int, msg: tuple) -> None:
        """One message to a client. Client 0's broken pipe ends the loop (the parent is gone); another client's
        detaches it."""
        if client in self.gone:
            return
        try:
            self.conns[client].send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            if client == 0:
                raise
            log.error("HTTP server %d went away: its requests are aborted", client)
            self._detach(client)

    def _detach(self, client: int) -> None:
        """A client that is gone: its requests are aborted (their blocks freed), nothing more is sent to it."""
        if client == 0 or client in self.gone:
            return
        self.gone.add(client)
        for rid in [r for r, c in self.owner.items() if c == client]:
            self._forget(rid)
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - a broken engine: the step's failure says so
                pass
        try:
            self.conns[client].close()
        except OSError:
            pass

    def _forget(self, rid: str) -> None:
        self.sent.pop(rid, None)
        self.owner.pop(rid, None)

    def _take(self, block: bool) -> list | None:
        """Every command waiting; when `block`, the first is waited for (None once the parent is gone)."""
        cmds = []
        while block:
            try:
                cmds.append(self.commands.get(timeout=IDLE_POLL_S))
                break
            except queue.Empty:
                if self.parent is not None and not self.parent.is_alive():
                    return None
        while True:
            try:
                cmds.append(self.commands.get_nowait())
            except queue.Empty:
                return cmds

    def _add(self, client: int, tag: int, items: list) -> tuple:
        eng, added = self.engine, []
        if client in self.gone:  # sent before it left: nobody would read the outputs
            return tag, ("error", f"HTTP server {client} has left"), None
        try:
            for rid, prompt, params in items:
                eng.add_request(prompt, params, request_id=rid)
                added.append(rid)
        except Exception as e:  # all or none
            for rid in added:
                eng.abort(rid)
            return tag, error_of(e), None
        for rid in added:
            self.sent[rid] = [0, 0, 0, False]
            self.owner[rid] = client
        return tag, None, None

    def _call(self, tag: int, fn) -> tuple:
        try:
            return tag, None, fn(self.engine)
        except Exception as e:  # noqa: BLE001 - the caller's to report
            return tag, error_of(e), None

    def _abort_all(self) -> None:
        for rid in list(self.sent):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - a broken engine: the requests are failed all the same
                pass
        self.sent.clear()
        self.owner.clear()

    def encode_output(self, out) -> tuple:
        """One `RequestOutput` as what it adds to what was sent before (`eyas.serve.core_client.Mirror.update`
        reads it)."""
        s = self.sent.get(out.request_id)
        if s is None:  # not added through this loop (never so): send it whole
            s = [0, 0, 0, False]
        ids = out.ids_since(s[0])
        s[0] += len(ids)
        pieces, count, stable_len, pending, length = out.text_parts.parts()
        start = min(s[1], count)  # pieces are only appended to, but never trust that across a process
        new_pieces = pieces[start:count]
        s[1] = count
        lps = out.logprobs_since(s[2])
        if lps is not None:
            s[2] += len(lps)
        plp = None
        if out.prompt_logprobs is not None and not s[3]:
            plp = out.prompt_logprobs
            s[3] = bool(out.num_output_tokens or out.finished)  # whole once a token is out
        if out.finished:
            self._forget(out.request_id)
        return (out.request_id, out.new_token_ids, ids, out.finished, out.finish_reason, out.num_prompt_tokens,
                out.num_cached_tokens, out.stats, start, new_pieces, count, stable_len, pending, length, lps, plp)


def core_main(llm_kwargs: dict, prepare, log_level: str, commands, conns: list) -> None:
    """The child process: build the engine (`eyas.LLM(**llm_kwargs)`, then `prepare(engine)` where given, e.g.
    capturing the CUDA graphs), say "ready" with its `EngineInfo` on client 0's pipe (or "failed to start" with the
    traceback), then run its loop for every client's pipe (`conns`). SIGINT is the parent's to handle (a terminal's
    Ctrl-C reaches the whole process group): the parent stops the child with "stop"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s (engine): %(message)s")
    try:
        from eyas import LLM
        from eyas.serve.async_engine import engine_counts, tree_depths
        eng = LLM(**llm_kwargs).engine
        if prepare is not None:
            prepare(eng)
        mcfg = eng.target.config
        info = EngineInfo(tokenizer=eng.tokenizer, vocab_size=mcfg.vocab_size, max_model_len=eng.max_model_len,
                          generation_defaults=mcfg.generation_defaults, eos_ids=sorted(eng.eos_ids),
                          tree_name=eng.tree.name, has_draft=eng.draft is not None,
                          spec_depth=eng.tree.max_depth if eng.draft is not None else 0,
                          tree_depths=tree_depths(eng), kv_total=eng.blocks.num_usable,
                          max_num_seqs=eng.scheduler.max_num_seqs, counts=engine_counts(eng))
    except BaseException:  # noqa: BLE001 - the parent raises it
        conns[0].send(("start failed", traceback.format_exc()))
        return
    freeze_heap("engine process")
    conns[0].send(("ready", info))
    core = EngineCore(eng, commands, conns)
    try:
        core.run()
    except (BrokenPipeError, EOFError, OSError):  # the parent went away
        pass
    except BaseException:  # a bug in the loop itself: the parent says so on /health and to every waiting client
        log.critical("engine loop died:\n%s", traceback.format_exc())
        for client in range(len(conns)):
            try:
                core._send(client, ("dead", traceback.format_exc()))
            except OSError:
                pass
