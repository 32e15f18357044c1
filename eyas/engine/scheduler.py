"""Continuous batching: waiting and running queues, chunked prefill under a token budget, preemption by recompute.

A step is either a prefill step (chunks of prompts, at most `max_num_batched_tokens` tokens) or a decode step (every
running sequence whose prefill is done advances by one speculative step). Prefill goes first, as in vLLM v0 and
nano-vllm. When the KV pool cannot hold the next decode step, the most recently arrived sequence is preempted: its
blocks are freed and it goes back to the front of the waiting queue, keeping its committed tokens (recompute).

Scheduling policy (`policy`, vLLM's `--scheduling-policy`): "fcfs" serves requests by arrival. "priority" serves
them by (`SamplingParams.priority`, arrival), lower first: the waiting queue is kept in that order, the decode
step's preemption takes the last in it, and a waiting request that cannot be admitted (the batch is full, or the
pool short of blocks) preempts running requests of lower priority (a larger value), last first, when that frees
enough for it (`_priority_victims`; vLLM v0's priority preemption).

Prefix caching (`BlockManager(prefix_caching=True)`, `eyas.cache.prefix_cache`): a sequence admitted to prefill
first takes the cached blocks its tokens begin with (`_prefix_hit`) and prefills only the rest. Its full blocks are
cached after each of its prefill steps and when it lets them go (finished, handed off or preempted: `cache_blocks`).
Requests that begin alike and arrive together (a request's `n` choices, a burst that shares a long system prompt)
would each compute the shared part, since blocks are cached only after the step that computes them. So a waiting
request that a sequence prefilling now would give at least SHARE_MIN_TOKENS more cached tokens waits for it
(`_waits_for_shared_prefix`; SGLang's in-batch prefix caching): its admission, and those behind it, move to a later
step, where it finds those blocks cached.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from eyas.cache.block_manager import BlockManager
from eyas.engine.sequence import Sequence, Status


# The least a waiting request must gain (tokens it would find cached once a sequence prefilling now has cached its
# blocks) to wait a step for it. A step's wait is worth a prefill of that many tokens or more.
SHARE_MIN_TOKENS = 64

POLICIES = ("fcfs", "priority")


@dataclass
class ScheduledBatch:
    kind: str  # "prefill" or "decode"
    seqs: list[Sequence]
    chunk_lens: list[int] = field(default_factory=list)  # prefill: tokens of each sequence in this step


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, lookahead: int,
                 min_admit: int = 1, with_draft: bool = False, policy: str = "fcfs", max_prefill_seqs: int = 0,
                 prefill_wait: float = 0.0):
        """`lookahead`: KV slots a decode step may fill beyond the committed ones (tree depth + 1). `min_admit`:
        while some sequence is decoding, waiting requests are admitted only once that many places in the batch are
        free (or all that wait fit): fewer, larger prefill steps for offline jobs (`EngineConfig.min_admit`).
        `with_draft`: the engine has a draft, whose KV a cached block must hold too. `policy`: "fcfs" or
        "priority" (the module's docstring). `max_prefill_seqs`: sequences a prefill step takes at most (0: no
        limit; `EngineConfig.max_prefill_seqs`). `prefill_wait` (seconds): while some sequence is decoding, waiting
        requests are admitted only once the earliest has waited that long, or a whole prefill step's worth
        (`max_prefill_seqs`) waits: arrivals a moment apart share one prefill step, which stalls every decoding
        sequence once, not once each (`EngineConfig.prefill_wait_ms`; vLLM v0's --scheduler-delay-factor)."""
        if min_admit < 1:
            raise ValueError(f"min_admit must be >= 1, got {min_admit}")
        if max_prefill_seqs < 0:
            raise ValueError(f"max_prefill_seqs must be >= 0 (0: no limit), got {max_prefill_seqs}")
        if prefill_wait < 0:
            raise ValueError(f"prefill_wait must be >= 0 s (EngineConfig.prefill_wait_ms), got {prefill_wait}")
        self.prefill_wait = prefill_wait
        self.clock = time.perf_counter  # what `Sequence.arrival` is read against
        self.max_prefill_seqs = max_prefill_seqs or max_num_seqs
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.blocks = blocks
        self.min_admit = min_admit
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.out_of_capacity: list[Sequence] = []  # sequences the whole pool can no longer hold: the engine ends them
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # a running sequence owns one (Sequence.slot)
        self.with_draft = with_draft
        self.prefix_queries = 0  # prefix caching: tokens looked up at admissions ...
        self.prefix_hits = 0  # ... and found cached

    def add(self, seq: Sequence) -> None:
        if self.policy == "priority":
            self._queue(seq)
        else:
            self.waiting.append(seq)

    def order(self, seq: Sequence) -> tuple:
        """A sequence's place in the queues: by arrival, or by (priority, arrival) under the priority policy."""
        return (seq.params.priority, seq.arrival) if self.policy == "priority" else (seq.arrival,)

    def _queue(self, seq: Sequence) -> None:
        """Priority policy: `seq` waits in its place by (priority, arrival), after those of equal order."""
        keys = [self.order(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self.order(seq)), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.cache_blocks(seq)
        self.blocks.release(seq.block_table)
        self._release_slot(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        seqs, chunks = [], []
        # sequences admitted earlier whose prompt is still being prefilled (their blocks are already reserved)
        for seq in [s for s in self.running if s.in_prefill]:
            if budget == 0 or len(seqs) == self.max_prefill_seqs:
                break
            chunk = min(seq.prefill_target - seq.num_cached, budget)
            seqs.append(seq)
            chunks.append(chunk)
            budget -= chunk
        if not self._admission_open():
            return ScheduledBatch("prefill", seqs, chunks) if seqs else None
        while self.waiting and budget > 0 and len(seqs) < self.max_prefill_seqs:
            seq = self.waiting[0]
            # admit only if the whole prompt and one decode step fit; the prompt's blocks are reserved at once
            hit = self._prefix_hit(seq)
            if self._waits_for_shared_prefix(seq, hit[0]):
                break
            if len(self.running) >= self.max_num_seqs or not self._fits(seq, hit[0]):
                victims = self._priority_victims(seq, hit[0], keep=seqs)
                if not victims:
                    break
                for v in victims:
                    self.preempt(v)
                hit = self._prefix_hit(seq)  # the victims' blocks may be cached now
                if len(self.running) >= self.max_num_seqs or not self._fits(seq, hit[0]):
                    break
            self.waiting.popleft()
            self._admit(seq, seq.prefill_target, hit)
            chunk = min(seq.prefill_target - seq.num_cached, budget)
            seqs.append(seq)
            chunks.append(chunk)
            budget -= chunk
        return ScheduledBatch("prefill", seqs, chunks) if seqs else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        ready = deque(sorted((s for s in self.running if not s.in_prefill), key=self.order))
        scheduled: list[Sequence] = []
        bs = self.blocks.block_size
        while ready:
            seq = ready.popleft()
            need = seq.num_cached + self.lookahead
            if len(seq.block_table) * bs >= need:  # most steps: its blocks already hold the step
                scheduled.append(seq)
                continue
            if self.blocks.blocks_needed([], need) > self.blocks.num_usable:
                self.out_of_capacity.append(seq)
                continue
            while not self.blocks.can_reserve(seq.block_table, need):
                victims = ready or [seq]
                victim = victims.pop()  # the latest arrival (of the lowest priority) gives way
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.reserve(seq.block_table, need)
                scheduled.append(seq)
        return ScheduledBatch("decode", scheduled) if scheduled else None

    def _admission_open(self) -> bool:
        """`min_admit` and `prefill_wait`: whether waiting requests may be admitted now. Always when nothing is
        decoding (no running sequence has finished its prefill), so nothing waits for places that will never free
        up."""
        if not any(not s.in_prefill for s in self.running):
            return True
        if (self.prefill_wait > 0 and self.waiting and len(self.waiting) < self.max_prefill_seqs
                and self.clock() - min(s.arrival for s in self.waiting) < self.prefill_wait):
            return False
        if self.min_admit <= 1:
            return True
        return self.max_num_seqs - len(self.running) >= min(self.min_admit, len(self.waiting))

    def can_admit(self) -> bool:
        """Whether the next `schedule()` would admit a waiting request (a free place in the batch, admission open
        (`min_admit`) and the blocks for its prompt and one decode step, or lower-priority requests to preempt for
        them: `_schedule_prefill`'s test)."""
        if not self.waiting or self.max_num_batched_tokens <= 0:
            return False
        if not self._admission_open():
            return False
        seq = self.waiting[0]
        hit = self._prefix_hit(seq)[0]
        if self._waits_for_shared_prefix(seq, hit):
            return False
        if len(self.running) >= self.max_num_seqs or not self._fits(seq, hit):
            return bool(self._priority_victims(seq, hit))
        return True

    def _priority_victims(self, seq: Sequence, hit: list[int], keep=()) -> list[Sequence]:
        """Priority policy: the running sequences of lower priority than `seq` (not in `keep`: this step's
        batch) to preempt, last in order first, so that `seq` is admitted: a place in the batch and enough free
        blocks (counting a victim's blocks as freed, whether or not another sequence shares them). [] when none
        would do, or under "fcfs"."""
        if self.policy != "priority":
            return []
        lower = sorted((s for s in self.running if s.params.priority > seq.params.priority and s not in keep),
                       key=self.order, reverse=True)
        need = self.blocks.blocks_needed(hit, seq.prefill_target + self.lookahead) + self.blocks.num_parked(hit)
        free, places, victims = self.blocks.num_free, self.max_num_seqs - len(self.running), []
        for v in lower:
            if places >= 1 and free >= need:
                break
            victims.append(v)
            free += len(v.block_table)
            places += 1
        return victims if places >= 1 and free >= need else []

    def _fits(self, seq: Sequence, hit: list[int]) -> bool:
        """Whether the pool holds `seq`'s prompt and one decode step, its first blocks being the cached `hit`."""
        need = self.blocks.blocks_needed(hit, seq.prefill_target + self.lookahead)
        return need + self.blocks.num_parked(hit) <= self.blocks.num_free

    # ---- prefix caching -----------------------------------------------------------------------------------
    def _waits_for_shared_prefix(self, seq: Sequence, hit: list[int]) -> bool:
        """Whether `seq` should wait: a running sequence still in prefill begins with the same tokens as `seq` for at
        least SHARE_MIN_TOKENS (whole blocks) past the `hit` that `seq` finds cached now, and will cache them (its
        prefill reaches past them, the draft's too). The wait ends when they are cached, or when no sequence in
        prefill shares them any more."""
        if self.blocks.prefix is None or seq.params.prompt_logprobs is not None:  # it takes no cached blocks
            return False
        B, ids = self.blocks.block_size, seq.token_ids
        need = len(hit) + -(-SHARE_MIN_TOKENS // B)  # blocks
        if need > (seq.prefill_target - 1) // B:  # more than a hit may take (one token is always prefilled)
            return False
        head = ids[: need * B + 1]  # a block's key holds the token after it
        return any(s.in_prefill and need * B < s.prefill_target and s.token_ids[: need * B + 1] == head
                   for s in self.running)

    def _prefix_hit(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """The cached blocks `seq`'s tokens begin with, and their entry ids: ([], []) without prefix caching.
        At least one token is left to prefill, as its logits give the first token (or, after a preemption, its
        hidden state is the draft's pending feature for the next step)."""
        cache = self.blocks.prefix
        if cache is None or seq.params.prompt_logprobs is not None:  # those need every prompt position computed
            return [], []
        if seq.prefix_memo is not None and seq.prefix_memo[0] == cache.version:  # a request that waits is looked
            return seq.prefix_memo[1]  # up at every step: again only once the cache has changed
        B, ids = self.blocks.block_size, seq.token_ids
        blocks, entries, parent = [], [], 0
        for b in range((seq.prefill_target - 1) // B):
            found = cache.lookup(parent, tuple(ids[b * B: (b + 1) * B + 1]))
            if found is None:
                break
            parent, block = found
            blocks.append(block)
            entries.append(parent)
        seq.prefix_memo = (cache.version, (blocks, entries))
        return blocks, entries

    def cache_blocks(self, seq: Sequence) -> None:
        """Offer `seq`'s full blocks to the prefix cache: those whose positions both caches hold (the target's,
        and the draft's where there is one; not past `draft_valid`), once the token after them is known (the key's
        last token)."""
        cache = self.blocks.prefix
        if cache is None:
            return
        B, ids = self.blocks.block_size, seq.token_ids
        drafted = seq.num_draft_cached if seq.draft_valid is None else seq.draft_valid
        done = min(seq.num_cached, drafted) if self.with_draft else seq.num_cached
        full = min(done, len(ids) - 1, len(seq.block_table) * B) // B
        parent = seq.prefix_entries[-1] if seq.prefix_entries else 0
        for b in range(len(seq.prefix_entries), full):
            parent = cache.insert(seq.block_table[b], parent, tuple(ids[b * B: (b + 1) * B + 1]))
            seq.prefix_entries.append(parent)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (their KV stays with the requests that hold them): later prompts find nothing
        cached until blocks are cached again, the running requests' included. Returns how many were forgotten."""
        n = self.blocks.forget_cached()
        for seq in self.running:
            seq.prefix_entries.clear()
        return n

    def admit_prefilled(self, seq: Sequence, num_cached: int) -> bool:
        """A request prefilled elsewhere (`LLMEngine.add_prefilled`) joins the running batch at once, with blocks
        for its `num_cached` entries and one decode step, when a place and the blocks are free (and no request
        waits before it); else False and nothing changes."""
        need = num_cached + self.lookahead
        if self.waiting or len(self.running) >= self.max_num_seqs or not self.blocks.can_reserve([], need):
            return False
        self._admit(seq, need)
        return True

    def _admit(self, seq: Sequence, num_slots: int, hit: tuple[list[int], list[int]] | None = None) -> None:
        """`seq` joins the running batch: a slot of its own and blocks for `num_slots` KV entries. An admission to
        prefill passes `hit` (`_prefix_hit`): the cached blocks to start its table with, whose positions it need
        not prefill, and their entries."""
        seq.status = Status.RUNNING
        seq.slot = self.free_slots.pop()
        self.running.append(seq)
        if hit is not None:  # ([], []) without prefix caching
            blocks, entries = hit
            self.blocks.share(blocks)
            seq.block_table[:] = blocks
            seq.prefix_entries[:] = entries
            seq.prefix_memo = None
            seq.num_cached = seq.prefix_hit = len(blocks) * self.blocks.block_size
            seq.num_draft_cached = seq.num_cached if self.with_draft else 0
            self.prefix_queries += seq.prefill_target
            self.prefix_hits += seq.num_cached
        self.blocks.reserve(seq.block_table, num_slots)

    def reserve_ahead(self, seqs: list[Sequence]) -> bool:
        """Overlapped decoding: before a step is enqueued behind the one in flight for `seqs`, reserve the KV blocks
        it may fill (the step in flight commits up to `lookahead` tokens the host has not seen yet, then this one up
        to `lookahead` more). No preemption: False (nothing reserved) when the pool cannot hold them all."""
        need = [(s, s.num_cached + 2 * self.lookahead) for s in seqs]
        if sum(self.blocks.blocks_needed(s.block_table, n) for s, n in need) > self.blocks.num_free:
            return False
        for s, n in need:
            self.blocks.reserve(s.block_table, n)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.cache_blocks(seq)
        self.blocks.release(seq.block_table)
        self._release_slot(seq)
        seq.reset_for_recompute()
        self.running.remove(seq)
        if self.policy == "priority":
            self._queue(seq)
        else:
            self.waiting.appendleft(seq)
