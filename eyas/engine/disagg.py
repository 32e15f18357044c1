"""Disaggregated prefill and decode: one engine prefills, another decodes.

A long prompt's prefill stalls every decoding request that shares its engine for as long as it runs. With the two
phases on separate engines (on separate GPUs: `LLM(..., disaggregate="cuda:0,cuda:1")`), decode steps do not wait
for prefills, and each engine's batches are of one kind.

* The prefill engine (`EngineConfig(role="prefill")`) admits requests, prefills them in chunks (the draft reads the
  prompt too), commits each one's first token, then hands it off (`LLMEngine.take_handoffs`): its committed tokens,
  its sampling state and the rows of every cache it has (target K/V, draft K/V, the draft's pending features), as
  contiguous tensors. Its blocks are freed there at once.
* The decode engine takes each handoff (`LLMEngine.add_prefilled`): the rows are copied into blocks of its own pool,
  and the request decodes from its next step exactly as if it had been prefilled there. When the decode engine has
  no place or blocks for it, it waits there and its tokens are prefilled again (as after a preemption): slower,
  never different.

The output is the same as one engine's, token for token, greedy or seeded (the sampler's randomness is a function of
(seed, position)); `tests/test_disagg.py` holds them equal. `DisaggregatedEngine` drives both with the interface of
one `LLMEngine` (what `LLM`, the server and the benchmarks step). With `threaded`, the prefill engine steps on a
thread of its own, so a decode step never waits for a prefill (on two GPUs their kernels run at once; the host's
work still shares one interpreter); otherwise each `step()` runs a step of each, in turn. The prefill engine can
also live in a process of its own (`eyas.engine.prefill_process`), with an interpreter of its own.
"""
from __future__ import annotations

import itertools
import threading

import torch

from eyas.engine.engine import Handoff, LLMEngine, RequestOutput
from eyas.engine.sequence import Sequence


class Tracked:
    """What `DisaggregatedEngine.add_request` returns: the request's sequence as it is now (the prefill engine's,
    then the decode engine's), read through (`finished`, `output_ids`, `text`, `stats`, ...)."""

    __slots__ = ("seq",)

    def __init__(self, seq: Sequence):
        self.seq = seq

    def __getattr__(self, name):
        return getattr(self.seq, name)

    @property
    def finished(self) -> bool:  # handed off is not finished: the decode engine goes on with it
        return self.seq.finished and self.seq.finish_reason != "handoff"


class DisaggregatedEngine:
    """Two `LLMEngine`s of the same model, `prefill` (role "prefill") and `decode`, driven as one. Not thread-safe:
    one caller (an `LLM`, the server's engine loop) calls everything but the prefill thread's own loop."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine, threaded: bool = False):
        if prefill.config.role != "prefill":
            raise ValueError("the prefill engine needs EngineConfig(role='prefill')")
        if decode.config.role != "both":
            raise ValueError("the decode engine must keep its requests (role 'both')")
        if prefill.target.config.vocab_size != decode.target.config.vocab_size:
            raise ValueError("the prefill and decode engines must serve the same model")
        if (prefill.draft is None) != (decode.draft is None):
            raise ValueError("the prefill and decode engines must both have the draft, or neither")
        self.prefill, self.decode = prefill, decode
        self.device = next(decode.target.parameters()).device
        self.threaded = threaded
        self.live: dict[str, Tracked] = {}  # unfinished requests by id
        self._ids = itertools.count()
        # the prefill side: its commands in, its outputs and handoffs out (under _lock, when threaded)
        self._lock = threading.Lock()
        self._commands: list[tuple] = []
        self._outputs: list[RequestOutput] = []
        self._handoffs: list[Handoff] = []
        self._error: BaseException | None = None
        self._wake = threading.Event()  # the prefill thread has work
        self._ready = threading.Event()  # the prefill thread has output
        self._stop = False
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._prefill_loop, name="eyas-prefill", daemon=True)
            self._thread.start()

    # ---- the face of one LLMEngine --------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.decode.tokenizer

    @property
    def max_model_len(self) -> int:
        return min(self.prefill.max_model_len, self.decode.max_model_len)

    def __getattr__(self, name):  # draft, tree, blocks, scheduler, runner, step_counts, ...: the decode engine's
        if name in ("prefill", "decode"):
            raise AttributeError(name)
        return getattr(self.decode, name)

    def encode(self, prompt):
        return self.decode.encode(prompt)

    def grammar_backend(self):
        """Both engines' (each has its own, made under its own lock): the server warms them beside startup."""
        self.prefill.grammar_backend()
        return self.decode.grammar_backend()

    def add_request(self, prompt, params=None, request_id: str | None = None) -> Tracked:
        """Check the request (ValueError for bad input, as `LLMEngine.add_request`) and queue it for prefill."""
        if request_id is not None and request_id in self.live:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.decode.check_request(prompt)  # tokenised once; the decode engine's pool must hold it too
        seq = self.prefill.new_sequence(ids, params, request_id or f"disagg-{next(self._ids)}")
        self.live[seq.request_id] = handle = Tracked(seq)
        self._command(("add", seq))
        return handle

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (queued for prefill, prefilling, handed off, decoding); False if it is
        unknown or finished. Its outputs and handoff, if any are still on their way, are dropped."""
        if self.live.pop(request_id, None) is None:
            return False
        self._command(("abort", request_id))
        self.decode.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        """The outputs of the prefill steps since the last call (one step when not threaded), then of one decode
        step. Handed-off requests join the decode engine before its step."""
        if not self.threaded:
            self._run_prefill()
        elif self._error is not None:
            raise RuntimeError("the prefill thread failed") from self._error
        with self._lock:
            outputs, self._outputs = self._outputs, []
            handoffs, self._handoffs = self._handoffs, []
            self._ready.clear()
        outputs = [o for o in outputs if o.request_id in self.live]  # an aborted request's are dropped
        for h in handoffs:
            if h.request_id in self.live:
                self.live[h.request_id].seq = self.decode.add_prefilled(h.to(self.device))
        if self.decode.has_unfinished():
            outputs += self.decode.step()
        elif self.threaded and not outputs:
            self._ready.wait(0.01)  # nothing to decode yet: wait for the prefill thread, do not spin
        for o in outputs:
            if o.finished:
                self.live.pop(o.request_id, None)
        return outputs

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
        close = getattr(self.prefill, "close", None)  # a prefill engine in its own process
        if close is not None:
            close()

    # ---- the prefill side ---------------------------------------------------------------------------------------
    def _command(self, cmd: tuple) -> None:
        with self._lock:
            self._commands.append(cmd)
        self._wake.set()

    def _run_prefill(self) -> bool:
        """Apply the queued commands and run one prefill engine step if it has work; whether it did."""
        with self._lock:
            commands, self._commands = self._commands, []
        for cmd in commands:
            if cmd[0] == "add":
                self.prefill.enqueue(cmd[1])
            else:
                self.prefill.abort(cmd[1])
        if not self.prefill.has_unfinished():
            return False
        outputs = self.prefill.step()
        handoffs = self.prefill.take_handoffs()
        with self._lock:
            self._outputs += outputs
            self._handoffs += handoffs
            self._ready.set()
        return True

    def _prefill_loop(self) -> None:
        try:
            while not self._stop:
                if not self._run_prefill():
                    self._wake.wait(0.01)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - the next step() raises it
            self._error = e
            self._ready.set()


def split_devices(spec: str) -> tuple[torch.device, torch.device]:
    """"cuda:0,cuda:1" -> (prefill device, decode device)."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"disaggregate takes 'PREFILL_DEVICE,DECODE_DEVICE' (e.g. cuda:0,cuda:1), got {spec!r}")
    return torch.device(parts[0]), torch.device(parts[1])
