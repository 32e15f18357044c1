"""LLMEngine: requests in, tokens out. One scheduler, one runner, one block pool, stepped by the caller
(the offline `LLM`, the server's engine loop, the benchmarks).

Overlapped decoding (`EngineConfig.overlap`, on with CUDA graphs): while a decode batch continues unchanged, each
`step()` enqueues the next decode step before it reads the current one back (`_successor`), so reading back,
committing, detokenising and packing run on the host while the GPU computes; the successor's inputs are carried on
the device (`eyas.spec.carry`). Every `step()` still returns the outputs of exactly one step."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from eyas.cache.block_manager import BlockManager
from eyas.cache.kv_cache import KVCache
from eyas.engine.detokenizer import NO_TEXT, WHOLE, IncrementalDetokenizer, OutputText, decoding_of
from eyas.engine.runner import ModelRunner
from eyas.engine.scheduler import Scheduler
from eyas.engine.sequence import Sequence, SpecStats
from eyas.loader.tokenizer import Tokenizer
from eyas.models.eagle import EagleDraft
from eyas.models.llama import LlamaForCausalLM
from eyas.sampling_params import SamplingParams
from eyas.spec.grammar import LazyGrammarBackend, unmasked
from eyas.spec.tree import Tree


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_bytes
    kv_cache_bytes: int | None = None  # None: 1 GiB on CPU, 60% of free GPU memory on CUDA
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # sequences a prefill step takes at most. None: where prefills replay CUDA graphs, the graphs' largest batch
    # (`prefill_graph.BATCH_BUCKETS`, 16), since a larger wave prefills eagerly at its own shape, host-bound on a
    # small model and compiling the attention's Triton kernels at each new shape: at 64 concurrent requests on an
    # H100 the shipped draft's server gave 3,851 tokens/s without the cap, 19,056 with it (session 68). Else no
    # limit. 0: no limit
    max_prefill_seqs: int | None = None
    max_model_len: int | None = None  # None: the model's context length
    cuda_graphs: bool = False  # replay whole decode steps from CUDA graphs (device="cuda")
    # batch-1 plain decode steps on the one-row kernels where the target allows (eyas.models.one_row; with Triton)
    one_row: bool = True
    # verify passes and plain steps of 2 to 64 tokens on the same path's tile kernels, for small models where they
    # pay (eyas.models.one_row.few_rows_pay)
    few_rows: bool = True
    # the target's RMSNorm weights folded into its projections, two launches a layer fewer on the steps that do not
    # take the one-row kernels (eyas.models.fused.fold_norms)
    fold_norms: bool = True
    # overlapped decoding (eyas.spec.carry): enqueue the next decode step of an unchanged batch before reading this
    # one back, so the host's work between steps runs while the GPU computes. None: on with `cuda_graphs`
    overlap: bool | None = None
    # admit waiting requests only once this many places in the batch are free (or all that wait fit) while others
    # decode: an offline job's prefill steps come fewer and larger (`make-distill-data`); 1 (admit at once) keeps a
    # server's time to first token
    min_admit: int = 1
    # while requests decode, a new one waits up to this long (ms) for others to share its prefill step, each of
    # which stalls every decoding request (eyas.engine.scheduler, `prefill_wait`); 0: admitted at the next step
    prefill_wait_ms: float = 0.0
    # "prefill": every request is handed off once its prompt is prefilled and its first token committed
    # (`take_handoffs`), for a decode engine to go on with it (`add_prefilled`; eyas.engine.disagg). "both": prefill
    # and decode here
    role: str = "both"
    # prefix caching (eyas.cache.prefix_cache): full KV blocks (target and draft) outlive their request, and a prompt
    # that begins with the same tokens takes them instead of prefilling them again
    prefix_caching: bool = True
    # "fcfs" (by arrival) or "priority" (by SamplingParams.priority, then arrival; lower-priority running requests
    # are preempted for higher ones): vLLM's --scheduling-policy (eyas.engine.scheduler)
    scheduling_policy: str = "fcfs"


@dataclass(eq=False)
class Handoff:
    """A request one engine prefilled, for another to decode (disaggregated prefill and decode,
    `eyas.engine.disagg`): its committed tokens and sampling state, and the rows of every cache it has, as
    contiguous tensors (on the prefill engine's device; `to` moves them)."""
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # prompt and output so far
    params: SamplingParams
    seed: int
    num_cached: int  # target KV entries (positions 0..num_cached-1)
    num_draft_cached: int
    target_kv: torch.Tensor  # [2, layers, num_cached, kv_heads, head_dim]: K then V
    draft_kv: torch.Tensor | None  # [2, draft layers, num_draft_cached, kv_heads, head_dim]
    pending: torch.Tensor | None  # [num_cached - num_draft_cached, H]: the features the draft has still to read
    arrival: float = 0.0
    first_token_time: float | None = None
    prefix_hit: int = 0  # KV entries the prefill engine found in its prefix cache
    logprobs: list | None = None  # the output tokens' `TokenLogprobs`, when the request asked for them
    prompt_logprobs: list | None = None  # the prompt tokens' (from the second on), when it asked for them

    def to(self, device) -> "Handoff":
        import dataclasses
        move = (lambda t: None if t is None else t.to(device))
        return dataclasses.replace(self, target_kv=move(self.target_kv), draft_kv=move(self.draft_kv),
                                   pending=move(self.pending))


class RequestOutput:
    """What one step produced for one request: the streaming delta (`new_token_ids`) and the running totals as the
    step left them (`token_ids`, `text`).

    The totals are read when asked for, from the sequence's token list (which only grows) and the detokenizer's
    text pieces (`OutputText`), so a step costs O(new tokens) per request whatever the output's length: copying
    the whole output at every step made long generations at large batches pay O(output) per request per step.
    `num_output_tokens` and `text_since(i)` are the cheap reads for streaming."""

    __slots__ = ("request_id", "new_token_ids", "finished", "finish_reason", "num_prompt_tokens", "stats", "_ids",
                 "_end", "_text", "num_cached_tokens", "_logprobs", "_lp_end", "prompt_logprobs")

    def __init__(self, request_id: str, new_token_ids: list[int], finished: bool, finish_reason: str | None,
                 num_prompt_tokens: int, stats: SpecStats | None = None, ids: list[int] | None = None,
                 text: OutputText = NO_TEXT, num_cached_tokens: int = 0, logprobs: list | None = None,
                 prompt_logprobs: list | None = None):
        """`ids`: the sequence's token ids, prompt first (shared, not copied; their first `num_prompt_tokens` are
        the prompt's); the output is ids[num_prompt_tokens:len(ids)] as they are now. `num_cached_tokens`: prompt
        tokens the prefix cache held when the request was admitted (OpenAI's usage `cached_tokens`). `logprobs`: the
        sequence's `TokenLogprobs` (shared, like `ids`), when its request asked for them; `prompt_logprobs`: those of
        its prompt tokens from the second on (`SamplingParams.prompt_logprobs`; complete once a token is out)."""
        self.num_cached_tokens = num_cached_tokens
        self.prompt_logprobs = prompt_logprobs
        self._logprobs = logprobs
        self._lp_end = len(logprobs) if logprobs is not None else 0
        self.request_id, self.new_token_ids = request_id, new_token_ids
        self.finished, self.finish_reason = finished, finish_reason
        self.num_prompt_tokens, self.stats = num_prompt_tokens, stats if stats is not None else SpecStats()
        self._ids = ids if ids is not None else []
        self._end = max(len(self._ids), num_prompt_tokens)
        self._text = text

    @property
    def token_ids(self) -> list[int]:
        """Every output token so far (a new list)."""
        return self._ids[self.num_prompt_tokens:self._end]

    @property
    def num_output_tokens(self) -> int:
        return self._end - self.num_prompt_tokens

    @property
    def logprobs(self) -> list | None:
        """Every output token's `eyas.layers.logprobs.TokenLogprobs` so far (None unless the request asked)."""
        return None if self._logprobs is None else self._logprobs[:self._lp_end]

    @property
    def new_logprobs(self) -> list | None:
        """Those of `new_token_ids`."""
        return None if self._logprobs is None else self._logprobs[self._lp_end - len(self.new_token_ids):self._lp_end]

    @property
    def text(self) -> str:
        """The output's text so far (stop strings cut)."""
        return str(self._text)

    def text_since(self, start: int) -> str:
        """`text[start:]`, at the cost of what it returns."""
        return self._text.since(start)

    def after(self, earlier: RequestOutput) -> RequestOutput:
        """This output with `earlier`'s (the same request's, the step before, never read) folded in: its new tokens
        (and so its new logprobs) are both steps'. Every other read is a running total already."""
        self.new_token_ids = earlier.new_token_ids + self.new_token_ids
        return self

    def ids_since(self, start: int) -> list[int]:
        """`token_ids[start:]`, at the cost of what it returns."""
        return self._ids[self.num_prompt_tokens + start:self._end]

    def logprobs_since(self, start: int) -> list | None:
        """`logprobs[start:]` (None unless the request asked), at the cost of what it returns."""
        return None if self._logprobs is None else self._logprobs[start:self._lp_end]

    @property
    def text_parts(self) -> OutputText:
        """The text as the step left it, in its parts (`OutputText`): what `eyas.serve.engine_core` sends on."""
        return self._text

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, new_token_ids={self.new_token_ids}, "
                f"num_output_tokens={self.num_output_tokens}, finished={self.finished}, "
                f"finish_reason={self.finish_reason!r})")


def encode_prompt(tokenizer: Tokenizer | None, vocab_size: int, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids: a text through the tokenizer, a list of ids checked (ValueError: what is wrong)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


class LLMEngine:
    def __init__(self, target: LlamaForCausalLM, tokenizer: Tokenizer | None, draft: EagleDraft | None = None,
                 tree: Tree | None = None, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        from eyas.spec.ngram import NgramProposer
        # n-gram speculation (`eyas.spec.ngram`): proposals from the host's tokens instead of a draft model
        self.proposer = draft if isinstance(draft, NgramProposer) else None
        draft = None if self.proposer is not None else draft
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        mcfg = target.config
        self.max_model_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        num_blocks = cfg.num_blocks or self._blocks_from_memory(target, draft)
        self.runner = ModelRunner(target, draft, tree, num_blocks, cfg.block_size, cuda_graphs=cfg.cuda_graphs,
                                  max_model_len=self.max_model_len, max_num_seqs=cfg.max_num_seqs,
                                  one_row=cfg.one_row, few_rows=cfg.few_rows, fold_norms=cfg.fold_norms,
                                  proposer=self.proposer)
        self.tree = self.runner.tree
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_caching)
        max_prefill_seqs = cfg.max_prefill_seqs
        if max_prefill_seqs is None:
            from eyas.engine.prefill_graph import BATCH_BUCKETS
            max_prefill_seqs = BATCH_BUCKETS[-1] if self.runner.prefill_graphs is not None else 0
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.runner.lookahead, cfg.min_admit, with_draft=draft is not None,
                                   policy=cfg.scheduling_policy, max_prefill_seqs=max_prefill_seqs,
                                   prefill_wait=cfg.prefill_wait_ms / 1000)
        self.seqs: dict[str, Sequence] = {}
        self.eos_ids = set(mcfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.step_counts = {"prefill": 0, "decode": 0}
        self.overlap = cfg.cuda_graphs if cfg.overlap is None else cfg.overlap
        self._inflight = None  # overlapped decoding: the decode step enqueued behind the one being read back
        self.decoding = decoding_of(tokenizer) if tokenizer is not None else WHOLE
        if cfg.role not in ("both", "prefill"):
            raise ValueError(f"role must be 'both' or 'prefill', got {cfg.role!r}")
        self.handoffs: list[Handoff] = []  # role "prefill": prefilled requests, for `take_handoffs`
        # guided decoding's tokenizer view and compiler (`grammar_backend`)
        self._grammar = LazyGrammarBackend(tokenizer, mcfg.vocab_size, self.eos_ids)

    def _blocks_from_memory(self, target, draft) -> int:
        cfg = self.config
        p = next(target.parameters())
        layers = target.config.num_hidden_layers + (draft.config.num_hidden_layers if draft is not None else 0)
        per_block = KVCache.bytes_per_block(target.config, layers, cfg.block_size, p.dtype)
        budget = cfg.kv_cache_bytes
        if budget is None:
            if p.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(p.device)
                budget = int(free * 0.6)
            else:
                budget = 1 << 30
        return max(2, min(budget // per_block, 1 << 20))

    # ---- requests ----------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, self.target.config.vocab_size, prompt)

    def check_request(self, prompt: str | list[int], request_id: str | None = None,
                      truncate: int | None = None) -> list[int]:
        """The prompt's token ids (its last `truncate` only, where given: `SamplingParams.truncate_prompt_tokens`), if
        this engine can take the request; ValueError (what is wrong) otherwise."""
        ids = self.encode(prompt)
        if truncate is not None:
            ids = ids[-truncate:]
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but the model's context is {self.max_model_len} "
                             "(prompt and output must fit)")
        capacity = self.blocks.num_usable * self.blocks.block_size
        if len(ids) + self.runner.lookahead > capacity:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than the KV cache holds ({capacity} slots)")
        if request_id is not None and request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        seq = self.new_sequence(prompt, params, request_id)
        self.enqueue(seq)
        return seq

    def new_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> Sequence:
        """A request's `Sequence`, checked (ValueError for bad input) but not queued: `add_request`'s first half,
        which reads only the engine's settings (`eyas.engine.disagg` makes sequences on one thread and queues them
        on the prefill engine's)."""
        params = params or SamplingParams()
        if params.priority != 0 and self.scheduler.policy != "priority":
            raise ValueError(f"priority {params.priority} needs the priority scheduling policy "
                             "(--scheduling-policy priority; EngineConfig(scheduling_policy='priority'))")
        ids = self.check_request(prompt, request_id, params.truncate_prompt_tokens)
        V = self.target.config.vocab_size
        if params.logit_bias is not None and any(t >= V for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {V}), got {max(params.logit_bias)}")
        if params.allowed_token_ids is not None and params.allowed_token_ids[-1] >= V:
            raise ValueError(f"allowed_token_ids must be token ids in [0, {V}), got {params.allowed_token_ids[-1]}")
        if params.guided is not None and (params.guided.after_token_id or 0) >= V:
            raise ValueError(f"guided after_token_id must be a token id in [0, {V}), got "
                             f"{params.guided.after_token_id}")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        grammar = self.grammar_state(params)  # a bad schema fails here, before the request is queued
        stop_ids = self._stop_ids(params)
        if params.min_tokens and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= stop_ids:
            raise ValueError("min_tokens: every one of allowed_token_ids stops the output, so none could be drawn "
                             "before min_tokens")
        bad_words = self._bad_words(params, stop_ids)
        seq = Sequence(ids, params, seed, request_id=request_id or "", stop_ids=stop_ids, grammar=grammar,
                       bad_words=bad_words)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, len(ids), self.decoding,
                                              params.skip_special_tokens)
        return seq

    def _bad_words(self, params: SamplingParams, stop_ids: frozenset[int]) -> tuple[tuple[int, ...], ...]:
        """A request's bad words as token sequences (`eyas.layers.bad_words`), checked: ValueError for words without
        a tokenizer, over the limits, or that could leave no token to draw."""
        if not params.has_bad_words:
            return ()
        from eyas.layers.bad_words import check_word_ids, word_token_ids
        seqs = list(params.bad_words_token_ids or [])
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs the model's tokenizer (bad_words_token_ids takes token ids)")
            seqs += word_token_ids(params.bad_words, lambda t: self.tokenizer.encode(t, add_bos=False))
        V = self.target.config.vocab_size
        words = check_word_ids(seqs, V)
        # a token no word ends with is never refused by them: if there is none (among allowed_token_ids, or not
        # refused already before min_tokens), some context could leave nothing to draw
        ends = {w[-1] for w in words} | (stop_ids if params.min_tokens else frozenset())
        pool = set(params.allowed_token_ids) if params.allowed_token_ids is not None else None
        if (pool <= ends) if pool is not None else len({t for t in ends if t < V}) >= V:
            raise ValueError("bad_words could refuse every token " + (
                "of allowed_token_ids" if pool is not None else "of the vocabulary"))
        return words

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end a request's output: its stop_token_ids, and EOS unless ignore_eos."""
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)

    def enqueue(self, seq: Sequence) -> None:
        """`add_request`'s second half: the sequence waits for admission."""
        if seq.request_id in self.seqs:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def grammar_state(self, params: SamplingParams):
        """A guided request's grammar state (`eyas.spec.grammar`), None for the others. ValueError for a spec that
        does not compile, or a model without a tokenizer."""
        if params.guided is None:
            return None
        return self.grammar_backend().state(params.guided)

    def grammar_backend(self):
        """Guided decoding's view of the tokenizer and its compiler (`eyas.spec.grammar.GrammarBackend`), made once:
        0.65 s for SmolLM2's 49k tokens on this repository's CPU (`tools/diag/guided_mask_cost.py`), which a server
        spends beside startup rather than at its first guided request."""
        return self._grammar.get()

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks. Returns False if it is unknown or already finished."""
        seq = self.seqs.pop(request_id, None)
        if seq is None or seq.finished:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        except BaseException:
            self._inflight = None  # a failed step's successor is not read back (its caller aborts the requests)
            raise

    def _step(self) -> list[RequestOutput]:
        if self._inflight is not None:  # overlapped decoding: the step enqueued last time is read back now
            h, self._inflight = self._inflight, None
            return self._decoded(h)
        batch = self.scheduler.schedule()
        outputs = []
        for seq in self.scheduler.out_of_capacity:  # it outgrew the whole KV pool
            outputs.append(self._finish(seq, "length"))
        self.scheduler.out_of_capacity.clear()
        if batch is None:
            if self.has_unfinished() and not outputs:
                raise RuntimeError("scheduler stalled: unfinished requests but nothing schedulable (a bug)")
            return outputs
        self.step_counts[batch.kind] += 1
        if batch.kind == "prefill":
            for seq, tok in zip(batch.seqs, self.runner.prefill(batch.seqs, batch.chunk_lens)):
                self.scheduler.cache_blocks(seq)
                if tok is not None:
                    seq.first_token_time = seq.first_token_time or time.perf_counter()
                    out = self._commit(seq, [tok])
                    outputs.append(out)
                    if self.config.role == "prefill" and not out.finished:
                        self._hand_off(seq)
        else:
            outputs += self._decoded(self.runner.launch(batch.seqs))
        return outputs

    def _decoded(self, h) -> list[RequestOutput]:
        """Read back the decode step `h` (a `StepHandle`) and commit its tokens; with overlap, first enqueue the
        step after it (`_successor`), which the next `step()` reads back."""
        self._inflight = self._successor(h)
        outputs = []
        new_tokens, accepted = self.runner.collect(h)
        depth = self.tree.max_depth
        for seq, toks, m in zip(h.seqs, new_tokens, accepted):
            if not toks:  # it finished (was aborted) while the step was in flight
                continue
            if unmasked(seq.grammar, seq.params.has_penalties):  # its step ran unmasked:
                keep = seq.grammar.cut_at_gate(toks)  # nothing after its gate token stays (eyas.spec.grammar)
                if keep < len(toks):
                    seq.num_cached -= len(toks) - keep  # their KV entries are not the sequence's
                    toks, m = toks[:keep], min(m, keep)
            out = self._commit(seq, toks)
            st = seq.stats
            st.target_calls += 1
            st.committed += len(out.new_token_ids)
            by_depth = st.accepted_by_depth
            if len(by_depth) < depth:
                by_depth += [0] * (depth - len(by_depth))
            for d in range(m):
                by_depth[d] += 1
            outputs.append(out)
        return outputs

    def _successor(self, h):
        """Overlapped decoding: enqueue the next step of `h`'s batch before `h` is read back, when that batch would
        be scheduled again: no waiting request could be admitted now (a full batch, or too few free blocks, keeps
        them waiting either way), every running sequence is in it, none can reach the context limit in `h`, not all
        of them can reach their token limits in `h` (a successor that may be wasted whole is not worth it; at batch
        1 this never costs a step), and the pool holds the blocks of both steps (`Scheduler.reserve_ahead`). Its
        inputs are carried on the device (`eyas.spec.carry`). A sequence that `h` ends (its token limit, an
        end-of-sequence token, a stop string) makes the successor's work for its row wasted, never wrong: its results
        are dropped (`ModelRunner.collect`), and the batch is scheduled anew after the successor. Returns the
        successor's handle, or None."""
        sched = self.scheduler
        if not self.overlap or sched.can_admit() or len(sched.running) != len(h.seqs):
            return None
        if any(s.grammar is not None for s in h.seqs):  # its masks need the grammar states after `h`'s commits
            return None
        if self.proposer is not None:  # n-gram proposals are made from the tokens `h` commits
            return None
        ahead = h.tree.max_depth + 1  # tokens `h` may commit
        if any(s.finished or len(s.token_ids) + ahead >= self.max_model_len for s in h.seqs):
            return None
        if all(s.num_output + ahead >= s.params.max_tokens for s in h.seqs):
            return None
        if not sched.reserve_ahead(h.seqs):
            return None
        self.step_counts["decode"] += 1
        return self.runner.launch(h.seqs, after=h)

    # ---- disaggregated prefill and decode -----------------------------------------------------------------
    def _hand_off(self, seq: Sequence) -> None:
        """Role "prefill": package a prefilled request (its committed tokens and every cache row it has) for a
        decode engine, and let it go here (its blocks and slot are freed)."""
        target_kv, draft_kv, pending = self.runner.read_sequence(seq)
        self.handoffs.append(Handoff(seq.request_id, list(seq.prompt_ids), list(seq.token_ids), seq.params, seq.seed,
                                     seq.num_cached, seq.num_draft_cached, target_kv, draft_kv, pending,
                                     seq.arrival, seq.first_token_time, seq.prefix_hit, list(seq.logprobs),
                                     list(seq.prompt_logprobs)))
        self.scheduler.finish(seq, "handoff")
        self.seqs.pop(seq.request_id, None)

    def take_handoffs(self) -> list[Handoff]:
        """The requests handed off since the last call (role "prefill"), oldest first."""
        out, self.handoffs = self.handoffs, []
        return out

    def add_prefilled(self, h: Handoff) -> Sequence:
        """Go on with a request another engine prefilled (`take_handoffs`; the same model). Its caches are copied
        into this engine's blocks and it decodes from its next step, exactly as if it had been prefilled here. When
        this engine has no place or blocks for it now, it waits instead, and its tokens are prefilled again here
        (as after a preemption): slower, never different. ValueError for caches of another model's shapes."""
        if h.request_id in self.seqs:
            raise ValueError(f"request id {h.request_id!r} is already in use")
        self.runner.check_handoff(h)
        params = h.params
        seq = Sequence(list(h.prompt_ids), params, h.seed, request_id=h.request_id, token_ids=list(h.token_ids),
                       stop_ids=self._stop_ids(params), grammar=self.grammar_state(params), arrival=h.arrival,
                       first_token_time=h.first_token_time, prefix_hit=h.prefix_hit, logprobs=list(h.logprobs or []),
                       prompt_logprobs=list(h.prompt_logprobs or []))
        if seq.grammar is not None:
            seq.grammar.accept(seq.output_ids)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.num_prompt, self.decoding,
                                              params.skip_special_tokens)
            seq.detok.update(seq.token_ids)
            seq.output_text = seq.detok.snapshot()
        self.seqs[seq.request_id] = seq
        if self.scheduler.admit_prefilled(seq, h.num_cached):
            self.runner.load_sequence(seq, h)
        else:
            self.scheduler.add(seq)
        return seq

    def _commit(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Append committed tokens, honouring stop tokens, stop strings, max_tokens and the context limit: never
        emit past them."""
        ids = seq.token_ids
        # how many tokens may go in before max_tokens or the context limit ends the output ("length")
        room = min(seq.params.max_tokens - (len(ids) - seq.num_prompt), self.max_model_len - len(ids))
        reason = None
        if len(tokens) < room and seq.stop_ids.isdisjoint(tokens):  # most steps: every token goes in
            added = list(tokens)
            ids.extend(added)
        else:
            added = []
            for t in tokens:
                ids.append(t)
                added.append(t)
                if t in seq.stop_ids:
                    reason = "stop"
                elif len(added) >= room:
                    reason = "length"
                if reason:
                    break
        if seq.grammar is not None and added:  # guided: the grammar takes the committed tokens; complete, it ends
            taken = seq.grammar.accept(added)   # the output (tokens after the one that completed it are dropped)
            if taken < len(added):
                del ids[len(ids) - (len(added) - taken):], added[taken:]
            if seq.grammar.terminated:
                reason = reason or "stop"
        if seq.detok is not None:
            cut = self._decode_added(seq, added)
            if cut >= 0:
                reason = "stop"
                if seq.params.include_stop_str_in_output:  # the text ends after the stop string, not before it
                    tail = seq.detok.tail(cut)
                    cut += len(next(s for s in seq.params.stop if tail.startswith(s)))
            seq.output_text = seq.detok.snapshot(cut)
        if seq.new_logprobs is not None:  # the kept tokens' log-probabilities
            seq.logprobs += seq.new_logprobs[:len(added)]
            seq.new_logprobs = None
        if reason:
            return self._finish(seq, reason, added)
        return RequestOutput(seq.request_id, added, False, None, seq.num_prompt, seq.stats, seq.token_ids,
                             seq.output_text, min(seq.prefix_hit, seq.num_prompt), _logprobs_of(seq),
                             _prompt_logprobs_of(seq))

    def _finish(self, seq: Sequence, reason: str, added: list[int] | None = None) -> RequestOutput:
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, added or [], True, reason, seq.num_prompt, seq.stats, seq.token_ids,
                             seq.output_text, min(seq.prefix_hit, seq.num_prompt), _logprobs_of(seq),
                             _prompt_logprobs_of(seq))

    @staticmethod
    def _decode_added(seq: Sequence, added: list[int]) -> int:
        """Decode the tokens just added to the output (incrementally: `seq.detok`). If a stop string shows in the
        text, drop the added tokens after the one that completed it (from `added` and `seq.token_ids`) and return
        where the text is cut (at the first stop string in it), else -1.

        The text before had no stop string, so only its last (longest stop - 1) characters and what is new are
        searched. Where one was found, the added tokens are decoded again one by one from the saved state, as
        the output ends at the first token whose text shows a stop string."""
        detok, stops = seq.detok, seq.params.stop
        first = len(seq.token_ids) - len(added)
        free = seq.params.min_tokens - (first - seq.num_prompt)  # 1-based index in `added` of the first token
        if not stops or free > len(added):  # whose text may end a stop string (vLLM's min_tokens): none here
            detok.update(seq.token_ids)
            return -1
        tail = max(map(len, stops)) - 1
        saved = detok.save()
        if free <= 1:  # every added token's text may end one: search them all at once first
            start = max(0, detok.stable_len - tail)
            detok.update(seq.token_ids)
            cut = _find_stop(detok.tail(start), stops, start)
            if cut < 0 or len(added) == 1:
                return cut
            detok.restore(saved)
        for k in range(1, len(added) + 1):
            start = max(0, detok.stable_len - tail)
            detok.update(seq.token_ids[:first + k])
            cut = _find_stop(detok.tail(start), stops, start) if k >= free else -1
            if cut >= 0:
                del seq.token_ids[first + k:], added[k:]
                return cut
        if free > 1:  # the step crossed min_tokens without a stop string
            return -1
        raise AssertionError("unreachable: the last token's text is the one searched first")


def _logprobs_of(seq: Sequence) -> list | None:
    return seq.logprobs if seq.params.logprobs is not None else None


def _prompt_logprobs_of(seq: Sequence) -> list | None:
    return seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None


def _find_stop(tail: str, stops: list[str], start: int) -> int:
    """Where the first stop string in `tail`, the text from character `start` on, begins (an index into the whole
    text), or -1."""
    i = min((i for i in (tail.find(s) for s in stops) if i >= 0), default=-1)
    return i + start if i >= 0 else -1
