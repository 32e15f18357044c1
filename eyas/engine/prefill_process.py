"""Disaggregated prefill in a process of its own (`LLM(..., disaggregate=..., prefill_process=True)`).

`eyas.engine.disagg` runs the prefill engine on a thread of the decode engine's process: their kernels overlap on two
GPUs, but the host's work of both shares one interpreter, and on a GPU the host's work is most of a small model's
step. Here the prefill engine lives in a child process (spawned: CUDA cannot be forked), with its own interpreter and
its own copy of the model on its device. `RemotePrefillEngine` stands for it in the parent, with the part of
`LLMEngine`'s interface that `DisaggregatedEngine` uses:

* `enqueue(seq)` sends the request (its token ids, sampling parameters and seed) to the child; `abort` likewise.
* The child steps its engine and sends back, per step, the tokens it committed per request and its handoffs, their
  cache rows on the CPU (shared memory: `torch.multiprocessing`'s queues pass tensors by handle).
* `step()` reads what the child sent: each committed token goes into the parent's own `Sequence` of the request
  (`LLMEngine._commit` of the decode engine: the same stop tokens, stop strings, grammar and token limits, so the
  parent ends a request exactly where the child did), and each handoff is returned by `take_handoffs` for the
  decode engine (`LLMEngine.add_prefilled`).

The output is the same as one engine's, token for token (tests/test_disagg.py); a failure in the child is raised in
the parent by the next `step()`, with the child's traceback.
"""
from __future__ import annotations

import queue
import time
import traceback
from types import SimpleNamespace

import torch.multiprocessing as mp

from eyas.engine.engine import Handoff, LLMEngine, RequestOutput
from eyas.engine.sequence import Sequence

START_TIMEOUT_S = 600.0  # loading the model in the child (a GPU's first compiles included)


class RemotePrefillEngine:
    """The parent's side of a prefill engine in a child process (see the module's docstring). `model` ... `draft_quant`
    and `engine_kwargs`: what `LLM` takes, for the child to load and build its engine (role "prefill") on `device`;
    `decode`: the decode engine, whose settings make the parent's sequences and commit their prefilled tokens."""

    def __init__(self, decode: LLMEngine, model: str, device: str, dtype: str, draft: str | None,
                 speculation: str | None, draft_quant: str | None, **engine_kwargs):
        ctx = mp.get_context("spawn")
        self.decode = decode
        self._commands = ctx.Queue()
        self._results = ctx.Queue()
        spec = dict(model=model, device=device, dtype=dtype, draft=draft, speculation=speculation,
                    draft_quant=draft_quant, engine_kwargs=engine_kwargs)
        self._proc = ctx.Process(target=_child_main, args=(spec, self._commands, self._results),
                                 name="eyas-prefill", daemon=True)
        self._proc.start()
        kind, *info = self._get(START_TIMEOUT_S)
        if kind != "ready":
            self.close()
            raise RuntimeError(f"the prefill process failed to start:\n{info[0]}")
        self.max_model_len, vocab_size, has_draft = info
        # what DisaggregatedEngine checks of a prefill engine: its role, its vocabulary, whether it has a draft
        self.config = SimpleNamespace(role="prefill")
        self.target = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size))
        self.draft = True if has_draft else None
        self.seqs: dict[str, Sequence] = {}  # requests sent and not yet handed off or finished
        self._handoffs: list[Handoff] = []

    # ---- what DisaggregatedEngine calls of a prefill engine -----------------------------------------------------
    def grammar_backend(self):
        """The child makes its own when a guided request first needs it."""
        return None

    def new_sequence(self, ids: list[int], params, request_id: str) -> Sequence:
        return self.decode.new_sequence(ids, params, request_id)

    def enqueue(self, seq: Sequence) -> None:
        self.seqs[seq.request_id] = seq
        self._commands.put(("add", seq.request_id, list(seq.prompt_ids), seq.params, seq.seed, seq.arrival))

    def abort(self, request_id: str) -> bool:
        self._commands.put(("abort", request_id))
        return self.seqs.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def step(self, wait: float = 0.01) -> list[RequestOutput]:
        """What the child committed since the last call (waiting up to `wait` seconds for it when nothing is there):
        the requests' outputs, as the parent's sequences take the tokens; their handoffs go to `take_handoffs`."""
        outputs = []
        msg = self._get(wait)
        while msg is not None:
            kind, *info = msg
            if kind == "error":
                raise RuntimeError(f"the prefill process failed:\n{info[0]}")
            committed, handoffs = info
            for rid, tokens, logprobs, prompt_logprobs in committed:
                seq = self.seqs.get(rid)
                if seq is None:  # aborted meanwhile
                    continue
                seq.first_token_time = seq.first_token_time or time.perf_counter()
                seq.new_logprobs = logprobs
                if prompt_logprobs is not None:
                    seq.prompt_logprobs = list(prompt_logprobs)
                out = self.decode._commit(seq, tokens)
                if out.finished:
                    self.seqs.pop(rid, None)
                outputs.append(out)
            for h in handoffs:
                if self.seqs.pop(h.request_id, None) is not None:
                    self._handoffs.append(h)
            msg = self._get(0)
        return outputs

    def take_handoffs(self) -> list[Handoff]:
        out, self._handoffs = self._handoffs, []
        return out

    def close(self) -> None:
        if self._proc.is_alive():
            self._commands.put(("stop",))
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)

    def _get(self, timeout: float):
        """The child's next message, waiting up to `timeout` seconds (in slices of a second, so that a child that
        died without a word is noticed), or None. RuntimeError if the child is gone."""
        end = time.monotonic() + timeout
        while True:
            try:
                left = end - time.monotonic()
                return self._results.get(timeout=min(left, 1.0)) if left > 0 else self._results.get_nowait()
            except queue.Empty:
                if not self._proc.is_alive():
                    # its last words (an error it put before returning) may reach the pipe after the timeout above
                    try:
                        return self._results.get(timeout=1.0)
                    except queue.Empty:
                        raise RuntimeError(f"the prefill process died (exit code {self._proc.exitcode})") from None
                if time.monotonic() >= end:
                    return None


def _child_main(spec: dict, commands, results) -> None:
    """The child: load the model, build the prefill engine, then apply commands and step until told to stop."""
    try:
        from eyas.engine.llm import LLM
        llm = LLM(spec["model"], device=spec["device"], dtype=spec["dtype"], draft=spec["draft"],
                  speculation=spec["speculation"], draft_quant=spec["draft_quant"], role="prefill",
                  **spec["engine_kwargs"])
        engine = llm.engine
        from eyas.engine.heap import freeze_heap
        freeze_heap("prefill process")
        results.put(("ready", engine.max_model_len, engine.target.config.vocab_size, engine.draft is not None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:  # block while there is nothing to prefill
                cmd = commands.get_nowait() if engine.has_unfinished() else commands.get()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    return
                if cmd[0] == "add":
                    _, rid, ids, params, seed, arrival = cmd
                    seq = engine.new_sequence(ids, params, rid)
                    # the parent's seed (its first token is sampled with it) and arrival (TTFT counts from there;
                    # perf_counter is the system's monotonic clock, the same in both processes)
                    seq.seed, seq.arrival = seed, arrival
                    engine.enqueue(seq)
                else:
                    engine.abort(cmd[1])
                try:
                    cmd = commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if not engine.has_unfinished():
                continue
            outputs = engine.step()
            committed = [(o.request_id, list(o.new_token_ids), o.new_logprobs, o.prompt_logprobs) for o in outputs]
            handoffs = [h.to("cpu") for h in engine.take_handoffs()]
            if committed or handoffs:
                results.put(("step", committed, handoffs))
    except BaseException:  # noqa: BLE001
        results.put(("error", traceback.format_exc()))
