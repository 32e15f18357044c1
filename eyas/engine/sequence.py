"""A request's state as the engine steps it.

Invariants between steps, for a sequence with committed tokens x_0..x_n (`token_ids`, n + 1 of them) once its
prefill is done:
* the target KV cache holds positions 0..n-1 (`num_cached == n`): the last token has no KV yet;
* the draft KV cache holds `num_draft_cached` positions, and the runner's `draft_hidden[slot]` holds (rows
  0..n-1-num_draft_cached) the target's final hidden states at positions num_draft_cached..n-1, which the draft still
  has to read (paired with tokens one to the right).

`slot`: while a sequence is running (admitted, not finished or preempted) it owns one slot in 0..max_num_seqs-1,
assigned by the scheduler; the runner keys its per-sequence device and host state by it and resets that state when a
prefill starts (`num_cached == prefix_hit`, the KV entries found in the prefix cache: admission, or re-admission
after preemption). -1 when not running.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eyas.engine.detokenizer import NO_TEXT, IncrementalDetokenizer, OutputText
from eyas.sampling_params import SamplingParams

if TYPE_CHECKING:
    from eyas.spec.grammar import GrammarState

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    target_calls: int = 0  # decode (verify) forwards this request took part in
    committed: int = 0  # tokens committed by those forwards
    accepted_by_depth: list[int] = field(default_factory=list)  # [d] = steps whose accepted path reached depth d+1

    @property
    def tokens_per_call(self) -> float:
        return self.committed / self.target_calls if self.target_calls else 0.0


@dataclass(eq=False)  # identity: sequences are compared by `is` in the queues
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    num_draft_cached: int = 0
    # where the draft cache stops holding the committed history: the draft skipped the pairs from here on (a plain
    # step without it, `ModelRunner.bare_tree`), though `num_draft_cached` counts them read; None: it holds them all
    draft_valid: int | None = None
    slot: int = -1
    stats: SpecStats = field(default_factory=SpecStats)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    output_text: OutputText = NO_TEXT  # the detokenised output as the last commit left it (stop strings cut)
    detok: IncrementalDetokenizer | None = None  # keeps `text` up to date (set by the engine when it has a tokenizer)
    stop_ids: frozenset[int] = frozenset()  # token ids that end the output (set by the engine: stop_token_ids + EOS)
    grammar: "GrammarState | None" = None  # guided decoding: the state after the committed output (eyas.spec.grammar)
    bad_words: tuple[tuple[int, ...], ...] = ()  # the request's bad words as token sequences (eyas.layers.bad_words)
    ngram_index: object | None = None  # n-gram speculation: its n-grams' latest ends (eyas.spec.ngram.NgramIndex)
    # prefix caching (eyas.cache.prefix_cache): the entries of the leading blocks of `block_table` that are cached
    # (or hold what a cached one holds), and how many KV entries the last admission found cached
    prefix_entries: list[int] = field(default_factory=list)
    prefix_hit: int = 0
    prefix_memo: tuple | None = None  # (the cache's version, its hit) while it waits (`Scheduler._prefix_hit`)
    # `params.logprobs` asked: each output token's `eyas.layers.logprobs.TokenLogprobs`, and those of the tokens the
    # runner's last step returned, which the engine's commit takes (as many as it keeps)
    logprobs: list = field(default_factory=list)
    new_logprobs: list | None = None
    # `params.prompt_logprobs` asked: the `TokenLogprobs` of prompt tokens 1, 2, ... (token 0 has none), as far as
    # prefill has computed them
    prompt_logprobs: list = field(default_factory=list)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if not self.request_id:
            self.request_id = str(self.seq_id)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def text(self) -> str:
        return str(self.output_text)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def prefill_target(self) -> int:
        """How many tokens the target must have in its KV before decoding: all, or all but the last sampled one."""
        return len(self.token_ids) if self.num_output == 0 else len(self.token_ids) - 1

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget every cached state; the committed tokens stay."""
        self.num_cached = 0
        self.num_draft_cached = 0
        self.draft_valid = None
        self.prefix_entries.clear()
        self.prefix_memo = None
        self.num_preemptions += 1
        self.status = Status.WAITING
