"""The model runner: owns the device, the KV caches and the models, and executes scheduled steps.

* `prefill(seqs, chunk_lens)`: runs prompt chunks through the target (writing their KV; on a GPU at padded shapes,
  replayed from CUDA graphs: `eyas.engine.prefill_graph`), lets the draft read the committed pairs the chunk
  completes, and samples the first token of sequences whose prompt is complete.
* `decode(seqs)`: one speculative step (`eyas.spec.step.spec_step`: draft -> verify -> accept -> commit), run eagerly
  or replayed from a CUDA graph. With no draft the tree is the bare root: plain decoding. It is `launch` (enqueue
  the step) then `collect` (wait, read it back, apply it to the sequences); overlapped decoding launches the next
  step of the same sequences before collecting this one (`launch(seqs, after=...)`: inputs carried on the device,
  `eyas.spec.carry`).

Host work per decode step is kept small and nearly flat in the batch size: every per-sequence input is packed into one
(pinned) host buffer and sent with one copy (`StepPacker`); settings and block tables live in per-slot host tables
(a running sequence owns the slot `seq.slot`, assigned by the scheduler) updated only when they change; the draft's
pending hidden states stay on the device, in `draft_hidden[slot]`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from eyas.cache.kv_cache import KVCache
from eyas.engine.sequence import Sequence
from eyas.layers.attention import MetaBuilder
from eyas.layers.penalties import Penalties, PenaltyState
from eyas.layers.sampler import filters_of, sampling_mode, threshold_for
from eyas.models.eagle import EagleDraft
from eyas.models.llama import LlamaForCausalLM
from eyas.spec.drafter import catch_up
from eyas.spec.step import DecodeInputs, DecodeOutputs, spec_step
from eyas.spec.tree import Tree


def padded(rows: list[list[int]], Q: int) -> torch.Tensor:
    out = torch.zeros(len(rows), Q, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def flat_slots(tables: np.ndarray, positions: np.ndarray, block_size: int, row_offsets: np.ndarray,
               out=None) -> np.ndarray:
    """Flat KV-cache slots of positions [B, P] through block tables [B, W] (host; `slots_for` on the device).
    `row_offsets`: [B, 1] = arange(B) * W (`StepPacker.row_offsets`, kept as its shapes are fixed)."""
    W = tables.shape[1]
    col = np.minimum(positions // block_size, W - 1)
    col += row_offsets  # flat indices into tables
    blk = tables.take(col)  # (cheaper on the host than take_along_axis)
    return np.add(np.multiply(blk, block_size, out=blk), positions % block_size, out=out)


def block_tables_of(seqs: list[Sequence], width: int | None = None) -> torch.Tensor:
    width = width or max(1, max(len(s.block_table) for s in seqs))
    return padded([s.block_table for s in seqs], width)


class StepPacker:
    """The inputs of a decode step of B rows, packed in one int64 buffer: a host one that the runner fills through
    numpy views (`np`), and a device one whose slices are the `DecodeInputs` tensors (a CUDA graph's static inputs are
    these slices). `send()` is the step's one host->device copy: on CUDA through a pinned staging buffer that is only
    ever written, in one sequential copy of the whole host buffer (no numpy arithmetic reads pinned memory).

    Layout, each field contiguous: root_tokens, num_cached, num_draft_cached, top_k, seeds, slots [B] each;
    commit_slots [B, P]; with a draft catchup_tokens, catchup_positions, catchup_slots [B, P] and catchup_lens [B];
    block_tables [B, W]; temperature, top_p and min_p [B] float32 each, in B + B // 2 int64 words (rounded up). The
    slots and positions are
    host arithmetic on the block tables, sent with the rest rather than computed by a dozen small kernels a step."""

    PER_STEP = ("commit_slots", "catchup_tokens", "catchup_positions", "catchup_slots", "proposed")  # [B, P] fields

    def __init__(self, B: int, P: int, W: int, with_draft: bool, device: torch.device, staging: bool | None = None,
                 with_proposals: bool = False):
        """`staging` (default: on CUDA) sends through a separate staging buffer, pinned on CUDA; off, the device
        copy reads the filled buffer itself. (Tests turn it on without CUDA to hold the staged path equal.)"""
        self.B = B
        sizes = [("root_tokens", B), ("num_cached", B), ("num_draft_cached", B), ("top_k", B), ("seeds", B),
                 ("slots", B), ("commit_slots", B * P)]
        if with_draft:
            sizes += [("catchup_tokens", B * P), ("catchup_positions", B * P), ("catchup_slots", B * P),
                      ("catchup_lens", B)]
        if with_proposals:  # n-gram speculation: the chain's tokens, proposed on the host
            sizes += [("proposed", B * P)]
        sizes += [("block_tables", B * W), ("floats", -(-3 * B // 2))]
        total = sum(n for _, n in sizes)
        pin = device.type == "cuda"
        staging = pin if staging is None else staging
        self.buf = np.zeros(total, dtype=np.int64)  # what the runner fills (ordinary memory)
        self.host = torch.zeros(total, dtype=torch.long, pin_memory=pin) if staging else torch.from_numpy(self.buf)
        self.stage = self.host.numpy() if staging else None  # the (pinned) staging copy of `buf`, written by send()
        self.dev = torch.zeros(total, dtype=torch.long, device=device)
        self.copied = torch.cuda.Event() if pin else None
        self.rows = None  # the key (slots in row order, the runner's slot_epoch) of the per-slot rows packed last
        self.row_offsets = (np.arange(B) * W)[:, None]  # `flat_slots`' flat index of each row's table
        # the event is recorded on the current stream of this device, looked up by its index: with no argument
        # torch.cuda.current_stream() first works out which device is current, a chain of Python calls (session 17:
        # the copy and the record took 40-55 us of host time a step on the H200 machine)
        self.device_index = (device.index if device.index is not None else torch.cuda.current_device()) if pin \
            else None
        self._readback: dict[tuple, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}
        self._flip = 0
        h, views, off = self.buf, {}, 0
        self.np: dict[str, np.ndarray] = {}
        self.span: dict[str, slice] = {}
        for name, n in sizes:
            d, a = self.dev[off: off + n], h[off: off + n]
            self.span[name] = slice(off, off + n)
            if name == "floats":
                floats = d.view(torch.float32)[:3 * B].view(3, B)
                views["temperature"], views["top_p"], views["min_p"] = floats.unbind(0)
                fa = a.view(np.float32)[:3 * B].reshape(3, B)
                self.np["temperature"], self.np["top_p"], self.np["min_p"] = fa[0], fa[1], fa[2]
            else:
                shape = (B, W) if name == "block_tables" else (B, P) if name in self.PER_STEP else (B,)
                views[name], self.np[name] = d.view(shape), a.reshape(shape)
            off += n
        draft_fields = ("catchup_tokens", "catchup_positions", "catchup_slots", "catchup_lens", "proposed")
        self.inputs = DecodeInputs(**{f: views.pop(f, None) for f in draft_fields}, max_context_len=0, **views)

    def send(self, part: slice | None = None) -> None:
        """Copy the host buffer to the device (`part`: only that slice of it, e.g. `self.span["block_tables"]`)."""
        part = part or slice(None)
        if self.stage is not None:
            if self.copied is not None:  # the previous copy out of the staging buffer must have finished (it has,
                self.copied.synchronize()  # after the step's synchronisation, so this costs nothing)
            np.copyto(self.stage[part], self.buf[part])
        self.dev[part].copy_(self.host[part], non_blocking=True)
        if self.copied is not None:
            self.copied.record(torch.cuda.current_stream(self.device_index))

    def readback(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Enqueue the copy of a step's packed outputs (`DecodeOutputs.packed`, [B, D+3]) to the host: returns the
        host tensor and the event after which it is complete (None: complete now). On CUDA: into one of two pinned
        buffers, alternately, so that a step and its overlapped successor (whose CUDA graph overwrites the same
        output tensor) each keep theirs; at most two steps are ever unread."""
        if self.copied is None:
            return packed, None
        key = (tuple(packed.shape), packed.dtype)
        bufs = self._readback.get(key)
        if bufs is None:
            bufs = self._readback[key] = [(torch.empty(key[0], dtype=packed.dtype, pin_memory=True),
                                           torch.cuda.Event()) for _ in range(2)]
        self._flip ^= 1
        buf, done = bufs[self._flip]
        buf.copy_(packed, non_blocking=True)
        done.record(torch.cuda.current_stream(self.device_index))
        return buf, done


def _entries(lps, i: int, k: int, n: int):
    """Row i's first n `TokenLogprobs` of host (chosen, top, top ids) tensors, with its own k alternatives."""
    from eyas.layers.logprobs import entries
    chosen, top_lp, top_ids = lps
    return entries(chosen[i], top_lp[i, ..., :k], top_ids[i, ..., :k], n)


def _is_chain(tree) -> bool:
    """A static tree whose nodes form one path (`chain:K`)."""
    return isinstance(tree, Tree) and all(set(p) == {0} for p in tree.paths) and len(tree.paths) == tree.max_depth


class ModelRunner:
    def __init__(self, target: LlamaForCausalLM, draft: EagleDraft | None, tree: Tree | None, num_blocks: int,
                 block_size: int, use_triton: bool | None = None, cuda_graphs: bool = False,
                 max_model_len: int = 0, max_num_seqs: int = 256, one_row: bool = True,
                 few_rows: bool = True, fold_norms: bool = True, proposer=None):
        """`proposer` (an `eyas.spec.ngram.NgramProposer`, without a draft): n-gram speculation along `tree`, a
        chain."""
        p = next(target.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.target, self.draft, self.proposer = target, draft, proposer
        if proposer is not None and (draft is not None or not _is_chain(tree)):
            raise ValueError(f"n-gram speculation proposes a chain (chain:K) without a draft model, got "
                             f"{getattr(tree, 'name', tree)!r}" + (" and a draft" if draft is not None else ""))
        speculates = draft is not None or proposer is not None
        self.tree = (tree if (tree is not None and speculates) else Tree.chain(0)).to(self.device)
        self.plain_tree = Tree.chain(0).to(self.device)  # n-gram steps where no sequence has a proposal
        # temperature bands that end in plain decoding (`TreeDispatch.plain_from`): a step whose requests are all at
        # least that hot runs this bare root without the draft, as an engine without one would: none of them will
        # ever speculate, so the draft need not read their tokens (it cost ~10% of a plain step, session 60)
        self.plain_from = getattr(self.tree, "plain_from", None) if draft is not None else None
        self.bare_tree = (None if self.plain_from is None
                          else dataclasses.replace(Tree.chain(0), name="plain").to(self.device))
        self._proposals: list[list[int] | None] | None = None  # this step's, made by `launch`
        if draft is not None:  # a dynamic tree's top-k must fit the vocabulary the draft proposes from
            ids = getattr(draft, "vocab_ids", None)
            vocab = target.config.vocab_size if ids is None else len(ids)
            for t in getattr(self.tree, "all_trees", [self.tree]):
                if getattr(t, "topk", 0) > vocab:
                    raise ValueError(f"{t.name}: top-{t.topk} of a draft that proposes from {vocab} tokens")
        self.block_size = block_size
        self.use_triton = (self.device.type == "cuda") if use_triton is None else use_triton
        if self.use_triton:  # fused projections and kernels (eyas.models.fused): in place, after any TP sharding
            from eyas.models.fused import enable_fast_path
            for m in (target, draft):
                if m is not None:
                    # `one_row` / `few_rows`: the target's steps of one token / of 2 to 64 and the draft's tree levels
                    # (eyas.models.one_row); few rows on a GPU only: under the CPU's Triton interpreter their GEMVs
                    # made test_spec's greedy chain:4 test take 116 s, against < 8.4 s on torch's matmuls (tests
                    # switch them on themselves)
                    # `fold_norms`: the target's norm weights folded into its projections (eyas.models.fused)
                    enable_fast_path(m, one_row=one_row, few_rows=few_rows and self.device.type == "cuda",
                                     fold=fold_norms)
        cfg = target.config
        self.cache = KVCache.allocate(cfg, cfg.num_hidden_layers, num_blocks, block_size, self.dtype, self.device)
        self.draft_cache = None
        if draft is not None:
            dc = draft.config
            self.draft_cache = KVCache.allocate(dc, dc.num_hidden_layers, num_blocks, block_size, self.dtype,
                                                self.device)
        # benchmarks: acceptance rates by depth or recorded rank paths (`spec_step`)
        self.simulated_accept: torch.Tensor | None = None
        self.tree_steps: dict[str, int] = {}  # decode steps run with each tree (a dispatcher uses several)
        self.guided_steps = 0  # decode steps that masked some request's logits by its grammar
        self._init_slots(max_num_seqs, max_model_len or cfg.max_position_embeddings)
        # prefill chunks at padded shapes (`eyas.engine.prefill_graph.prefill_shape`): on a GPU, graphed or not, so
        # that both compute the same; a CPU test may switch it on (the padding then changes what rounds, not what is
        # computed)
        self.pad_prefill = self.device.type == "cuda"
        from eyas.engine.prefill_graph import graph_tokens
        self.prefill_tokens = graph_tokens(target)  # the most padded tokens a chunk runs at (`prefill_shape`)
        self.graphs = self.prefill_graphs = None
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError("CUDA graphs need device='cuda'")
            from eyas.engine.cuda_graph import GraphedStep
            from eyas.engine.prefill_graph import PrefillGraphs
            self.graphs = GraphedStep(self, max_model_len)
            self.prefill_graphs = PrefillGraphs(self)

    def tree_for(self, batch_size: int, temperature: float = 0.0) -> Tree:
        """The tree a decode step of `batch_size` sequences uses (a `TreeDispatch` picks by batch size and, where it
        has temperature bands, by the step's highest temperature)."""
        t = self.tree
        return t.tree_for(batch_size, temperature) if hasattr(t, "tree_for") else t

    def draft_for(self, tree) -> EagleDraft | None:
        """The draft a step of `tree` runs: none for the bare tree of requests that never speculate (`bare_tree`).
        Its sequences' draft caches then fall behind; `collect` counts them as read all the same, so that a later
        step of theirs beside a cooler request, which reads along, has at most `lookahead` pairs to read (its output
        for them is never used: every step they take is plain), and marks where they stop holding the history
        (`Sequence.draft_valid`), past which no block of theirs is prefix-cached."""
        return None if tree is self.bare_tree else self.draft

    @property
    def lookahead(self) -> int:
        """KV slots a decode step may commit per sequence: the root plus one per tree level. Also the most
        committed pairs the draft has to catch up on at a decode step."""
        return self.tree.max_depth + 1

    # ---- per-slot state -----------------------------------------------------------------------------------
    def _init_slots(self, max_num_seqs: int, max_model_len: int) -> None:
        """Per-slot state of the running sequences; slot `num_slots` is scratch (the padded rows of a graph's batch
        read and write it). Host tables: block-table rows and sampling settings (written when they change); device:
        the draft's pending hidden states."""
        S = self.num_slots = max_num_seqs
        self.width = -(-(max_model_len + self.lookahead + 1) // self.block_size)  # block-table width for any sequence
        self.slot_block_tables = np.zeros((S + 1, self.width), dtype=np.int64)
        self.slot_num_blocks = np.zeros(S + 1, dtype=np.int64)
        self.slot_temperature = np.zeros(S + 1, dtype=np.float32)
        self.slot_top_p = np.ones(S + 1, dtype=np.float32)
        self.slot_min_p = np.zeros(S + 1, dtype=np.float32)
        self.slot_top_k = np.zeros(S + 1, dtype=np.int64)
        self.slot_seed = np.zeros(S + 1, dtype=np.int64)
        # [S + 1, P, H]: h_t for the pairs the draft has not read yet (rows 0..n-d-1), as the draft reads them
        # (`EagleDraft.read_features`: with feature layers, the fused features, H wide as well)
        self.draft_hidden = None
        if self.draft is not None:
            self.draft_hidden = torch.zeros(S + 1, self.lookahead, self.target.config.hidden_size, dtype=self.dtype,
                                            device=self.device)
        self.packers: dict[int, StepPacker] = {}
        # bumped whenever `decode_inputs` copies a block table's new blocks into its slot's row (a table grew, or a
        # slot was claimed: that resets its count): part of the key of every packer's cached per-slot rows, so that a
        # change seen through one packer invalidates the others' rows too
        self.slot_epoch = 0
        self.penalty_state: PenaltyState | None = None  # the penalties' per-slot counts, made at the first such step

    def _claim_slot(self, s: Sequence) -> None:
        """A sequence starts (or restarts, after preemption) its prefill in slot `s.slot`: reset the slot's rows."""
        if not 0 <= s.slot < self.num_slots:
            raise RuntimeError(f"sequence {s.request_id} has no slot (slot {s.slot})")
        i = s.slot
        self.slot_block_tables[i] = 0
        self.slot_num_blocks[i] = 0  # so the sequence's first decode step copies its whole table (slot_epoch moves)
        p = s.params
        self.slot_temperature[i], self.slot_top_p[i], self.slot_top_k[i] = p.temperature, p.top_p, p.top_k
        self.slot_min_p[i] = p.min_p
        self.slot_seed[i] = s.seed

    def packer(self, B: int) -> StepPacker:
        pk = self.packers.get(B)
        if pk is None:
            pk = self.packers[B] = StepPacker(B, self.lookahead, self.width, self.draft is not None, self.device,
                                              with_proposals=self.proposer is not None)
        return pk

    def _meta(self, seqs, max_context_len: int) -> MetaBuilder:
        return MetaBuilder(block_tables_of(seqs).to(self.device), self.block_size, max_context_len, self.use_triton)

    # ---- prefill ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], chunk_lens: list[int]) -> list[int | None]:
        """Run prompt chunks; return the first sampled token of each sequence whose prompt completes (else None)."""
        dev = self.device
        for s in seqs:
            if s.num_cached == s.prefix_hit:  # admitted (or re-admitted after preemption): the slot is its own now
                self._claim_slot(s)
        B = len(seqs)
        hidden, feats, logits, first, drafted = self._prefill_forward(seqs, chunk_lens)
        logits = logits[:B]  # (a graph's output: read before the next prefill replays)

        if any(s.params.prompt_logprobs is not None for s in seqs):
            self._prompt_logprobs(seqs, chunk_lens, hidden)
        states = [s.grammar for s in seqs]
        if any(st is not None for st in states):  # guided decoding: the first token as the grammar allows
            from eyas.spec.grammar import apply_bitmask, prefill_masks
            apply_bitmask(logits, prefill_masks(states, next(st for st in states if st is not None).words).to(dev))
        p = [s.params for s in seqs]
        pen = Penalties.of(seqs, logits.shape[-1], dev)
        if pen is not None:  # repetition penalties: the first token's by the prompt
            pen.apply(logits)
        lps = None
        if any(x.logprobs is not None for x in p):  # before the sampler's temperature, top-k and top-p
            lps = logits.float()
        if first is not None and pen is None and not filters_of(p) and all(st is None for st in states):
            sampled = first[:B]  # drawn in the prefill's step, from the logits as they are (`first_tokens`)
        else:
            # the seeds, and the counters of the chunks' last positions: one copy, each row contiguous
            ends = [s.num_cached + c - 1 for s, c in zip(seqs, chunk_lens)]
            seeds, counters = torch.tensor([[s.seed for s in seqs], ends], device=dev)
            sampled = self._first_tokens(logits, p, seeds, counters)
        if drafted:  # the draft read the chunk in the prefill's step (`prefill_graph.draft_read`)
            for s, c in zip(seqs, chunk_lens):
                s.num_draft_cached += c - 1 if s.num_draft_cached == s.num_cached else c
        elif self.draft is not None:
            self._draft_prefill(seqs, chunk_lens, self.draft.read_features(feats),
                                self._meta(seqs, max(s.num_cached for s in seqs)))
        if lps is not None:
            from eyas.layers.logprobs import token_logprobs
            lps = [t.cpu() for t in token_logprobs(lps[:, None], sampled[:, None], max(x.logprobs or 0 for x in p))]
        sampled = sampled.tolist()
        out: list[int | None] = []
        for i, (s, c) in enumerate(zip(seqs, chunk_lens)):
            s.num_cached += c
            out.append(sampled[i] if s.num_cached == s.prefill_target and s.num_output == 0 else None)
            if out[-1] is not None and s.params.logprobs is not None:
                s.new_logprobs = _entries(lps, i, s.params.logprobs, 1)
        return out

    def _prefill_forward(self, seqs, chunk_lens):
        """The target's forward over the chunks: (hidden, features, logits, first tokens, drafted), hidden and
        features [B', Q', ...], B' >= B and Q' >= the longest chunk, logits [B', V] at each row's last token, the
        tokens drawn from them [B'] where the step drew them (`prefill_graph.prefill_step`; else None). On a GPU at
        the padded shape of `eyas.engine.prefill_graph.prefill_shape`, replayed from a graph where the runner has CUDA
        graphs (the eager forward pads alike, so the two compute the same); there the draft reads the chunk in the
        same step (`prefill_graph.draft_read`: `drafted`), where its sequences stand where that expects (else
        `_draft_prefill` does, after)."""
        from eyas.engine.prefill_graph import (DRAFT_IN_PREFILL, last_logits, pack, prefill_context, prefill_forward,
                                               prefill_shape, prefill_step)
        B, Q = len(seqs), max(chunk_lens)
        starts = [s.num_cached for s in seqs]
        rows = [s.token_ids[s.num_cached: s.num_cached + c] for s, c in zip(seqs, chunk_lens)]
        shape = prefill_shape(B, Q, self.prefill_tokens) if self.pad_prefill else None
        if shape is None or max(len(s.block_table) for s in seqs) > self.width:  # (no graph's tables hold it)
            tables = block_tables_of(seqs).to(self.device)  # the chunk's own shape, tables as wide as the longest
            lens = torch.tensor(chunk_lens, device=self.device)
            hidden, feats = prefill_forward(self.target, self.cache, padded(rows, Q).to(self.device),
                                            torch.tensor(starts, device=self.device), lens, tables, self.block_size,
                                            max(starts), self.use_triton, getattr(self.draft, "feature_layers", None))
            return hidden, feats, last_logits(self.target, hidden, lens), None, False
        # every graph's tables are the runner's width; the split count for no prefix or for the whole width
        context = prefill_context(max(starts), self.width * self.block_size)
        drafted = (DRAFT_IN_PREFILL and self.draft is not None
                   and all(s.num_cached - s.num_draft_cached in (0, 1) for s in seqs))
        packed = pack(rows, starts, chunk_lens, [s.block_table for s in seqs], *shape, self.width,
                      [s.slot for s in seqs], [s.num_draft_cached for s in seqs], pad_slot=self.num_slots,
                      seeds=[s.seed for s in seqs], temperatures=[s.params.temperature for s in seqs])
        out = None
        if self.prefill_graphs is not None:
            out = self.prefill_graphs.run(packed, (*shape, context, drafted))
        if out is None:
            out = prefill_step(self, packed.to(self.device), *shape, context, drafted)
        return (*out, drafted)

    def _first_tokens(self, logits: torch.Tensor, params, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        """The tokens after the prompts (`prefill_graph.first_tokens`: the race a decode step draws its bonus by, at
        the prompt's last position's counter), among the tokens that top-k, top-p and min-p keep (one threshold a
        row, `filter_threshold`; radix selection on the Triton path)."""
        from eyas.engine.prefill_graph import first_tokens
        dev = logits.device
        t = torch.tensor([x.temperature for x in params], device=dev)
        tau = None
        if filters_of(params):
            settings = [torch.tensor([getattr(x, f) for x in params], device=dev) for f in ("top_k", "top_p", "min_p")]
            tau = threshold_for(self.use_triton)(logits, t, *settings)[0]
        return first_tokens(logits, t, seeds, counters, self.use_triton, tau=tau)

    def _prompt_logprobs(self, seqs, chunk_lens, hidden, rows_at_once: int = 512) -> None:
        """`params.prompt_logprobs`: the log-probabilities of the prompt tokens this chunk's positions predict
        (position p predicts token p + 1; the prompt's last position predicts the first output token, whose entry is
        the output's), from the target's raw logits, appended to `seq.prompt_logprobs`. Positions whose entries a
        sequence has (a prompt prefilled again after a preemption) are skipped. At most `rows_at_once` positions'
        logits at a time."""
        from eyas.layers.logprobs import entries, token_logprobs, token_ranks
        for i, (s, c) in enumerate(zip(seqs, chunk_lens)):
            k = s.params.prompt_logprobs
            if k is None:
                continue
            lo = max(len(s.prompt_logprobs), s.num_cached)  # positions lo..hi-1
            hi = min(s.num_cached + c, s.num_prompt - 1)
            for a in range(lo, hi, rows_at_once):
                b = min(a + rows_at_once, hi)
                logits = self.target.compute_logits(hidden[i, a - s.num_cached: b - s.num_cached])
                nxt = torch.tensor(s.token_ids[a + 1: b + 1], device=logits.device)
                lp = [t.cpu() for t in token_logprobs(logits, nxt, k)]
                s.prompt_logprobs += entries(*lp, b - a, token_ranks(logits, nxt).cpu())

    def _draft_prefill(self, seqs, chunk_lens, hidden, meta) -> None:
        """The draft reads the pairs (x_{t+1}, h_t) whose both halves this chunk made known: all but the chunk's last
        position, whose next token is not known yet. That hidden state waits in the slot's row 0 of `draft_hidden`.
        `hidden` [B, Q, H] is the target's output as the draft reads it (`EagleDraft.read_features` applied)."""
        dev = self.device
        tok_rows, feats = [], []
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        for i, (s, c) in enumerate(zip(seqs, chunk_lens)):
            end = s.num_cached + c  # target KV length after this chunk
            tok_rows.append(s.token_ids[s.num_draft_cached + 1: end])
            h = hidden[i, :c]
            # a first chunk starts at pair (x_{n+1}, h_n), n = num_cached (0, or the entries found in the prefix
            # cache); a later one with the pending h of the previous chunk's end
            first = s.num_draft_cached == s.num_cached
            feats.append(h if first else torch.cat([self.draft_hidden[s.slot, :1].to(h.dtype), h]))
        lens = [len(r) for r in tok_rows]
        P = max(max(lens), 1)
        H = hidden.shape[-1]
        hid = torch.zeros(len(seqs), P, H, dtype=hidden.dtype, device=dev)
        for i, f in enumerate(feats):
            hid[i, : lens[i]] = f[: lens[i]]
        if max(lens) > 0:
            start = torch.tensor([s.num_draft_cached for s in seqs], device=dev)
            catch_up(self.draft, self.target, self.draft_cache, padded(tok_rows, P).to(dev), hid,
                     torch.tensor(lens, device=dev), start, meta)
        last = torch.tensor(chunk_lens, device=dev) - 1
        self.draft_hidden[slots, 0] = hidden[torch.arange(len(seqs), device=dev), last].to(self.draft_hidden.dtype)
        for i, s in enumerate(seqs):
            s.num_draft_cached += lens[i]

    # ---- disaggregated prefill and decode: a sequence's cache rows out and in -----------------------------------
    def _flat_slots(self, seq: Sequence, n: int) -> torch.Tensor:
        pos = torch.arange(n)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    @staticmethod
    def _rows(cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
        """[2, layers, len(slots), kv_heads, head_dim]: K and V at flat cache slots."""
        return torch.stack([c.flatten(1, 2)[:, slots] for c in (cache.k, cache.v)])

    @torch.inference_mode()
    def read_sequence(self, seq: Sequence):
        """(target K/V, draft K/V or None, the draft's pending features or None) of a sequence, copied out of the
        caches (`LLMEngine._hand_off`)."""
        target_kv = self._rows(self.cache, self._flat_slots(seq, seq.num_cached))
        if self.draft is None:
            return target_kv, None, None
        draft_kv = self._rows(self.draft_cache, self._flat_slots(seq, seq.num_draft_cached))
        pending = self.draft_hidden[seq.slot, :seq.num_cached - seq.num_draft_cached].clone()
        return target_kv, draft_kv, pending

    def check_handoff(self, h) -> None:
        """ValueError unless a `Handoff`'s caches fit this runner's (the same target and draft shapes)."""
        def shape(cache):
            return tuple(cache.k.shape[i] for i in (0, 3, 4))  # layers, kv_heads, head_dim

        want = shape(self.cache)
        got = (h.target_kv.shape[1], *h.target_kv.shape[3:])
        if tuple(got) != want or h.target_kv.shape[2] != h.num_cached:
            raise ValueError(f"request {h.request_id}: target caches of shape {tuple(h.target_kv.shape)} do not fit "
                             f"this engine's target (layers, kv heads, head dim = {want})")
        if (h.draft_kv is None) != (self.draft is None):
            raise ValueError(f"request {h.request_id}: prefilled {'with' if h.draft_kv is not None else 'without'} "
                             f"a draft, but this engine has {'one' if self.draft is not None else 'none'}")
        if self.draft is not None and (tuple((h.draft_kv.shape[1], *h.draft_kv.shape[3:])) != shape(self.draft_cache)
                                       or h.draft_kv.shape[2] != h.num_draft_cached
                                       or h.pending.shape != (h.num_cached - h.num_draft_cached,
                                                              self.draft_hidden.shape[-1])):
            raise ValueError(f"request {h.request_id}: the draft's caches do not fit this engine's draft")

    @torch.inference_mode()
    def load_sequence(self, seq: Sequence, h) -> None:
        """Write a `Handoff`'s cache rows into `seq`'s blocks and slot (the scheduler gave it both): `seq` is then as
        if this runner had prefilled it."""
        self._claim_slot(seq)
        for cache, kv, n in ((self.cache, h.target_kv, h.num_cached), (self.draft_cache, h.draft_kv,
                                                                        h.num_draft_cached)):
            if kv is None:
                continue
            slots = self._flat_slots(seq, n)
            for c, rows in zip((cache.k, cache.v), kv):
                c.flatten(1, 2)[:, slots] = rows.to(self.device, c.dtype)
        if self.draft is not None:
            self.draft_hidden[seq.slot, :len(h.pending)] = h.pending.to(self.device, self.draft_hidden.dtype)
        seq.num_cached, seq.num_draft_cached = h.num_cached, h.num_draft_cached

    # ---- decode: one speculative step -----------------------------------------------------------------------
    @torch.inference_mode()
    def decode_inputs(self, seqs: list[Sequence], B: int | None = None) -> DecodeInputs:
        """Pack the sequences' host state into the B-row packer (B >= len(seqs); rows past the batch are padding) and
        send it to the device: the only host->device traffic of a step. Returns the packer's device views."""
        n = len(seqs)
        B = B or n
        pk = self.packer(B)
        a = pk.np
        bt = self.slot_block_tables
        roots, ncs, nds, slots = [], [], [], []
        cat_tokens = [] if self.draft is not None else None
        P = self.lookahead
        self._grow_slot_tables(seqs)
        for s in seqs:
            i, nc, nd = s.slot, s.num_cached, s.num_draft_cached
            tokens = s.token_ids
            roots.append(tokens[-1])
            ncs.append(nc)
            nds.append(nd)
            slots.append(i)
            if cat_tokens is not None:
                row = tokens[nd + 1: nc + 1]
                cat_tokens += row
                cat_tokens += [0] * (P - len(row))
        if self.proposer is not None:  # n-gram proposals (`launch` made them), the root repeated where none
            props = a["proposed"]
            props[:] = 0
            for r, (s, prop) in enumerate(zip(seqs, self._proposals or [None] * n)):
                props[r, :P - 1] = prop if prop is not None else s.token_ids[-1]
        if n < B:  # padding rows: nothing cached, the scratch slot (its block-table row is zeros)
            pad = B - n
            roots += [0] * pad
            ncs += [0] * pad
            nds += [0] * pad
            slots += [self.num_slots] * pad
            if cat_tokens is not None:
                cat_tokens += [0] * (pad * P)
        a["root_tokens"][:] = roots
        a["num_cached"][:] = ncs
        a["num_draft_cached"][:] = nds
        sl = a["slots"]
        if cat_tokens is not None:
            a["catchup_tokens"].reshape(-1)[:] = cat_tokens
        tables = a["block_tables"]
        # the per-slot rows (slot, block table, sampling parameters) change only when a row's sequence changes, a
        # slot is claimed or a table grows (both move slot_epoch): in steady decoding they are the last step's,
        # already in the buffer
        rows = (tuple(slots), self.slot_epoch)
        if pk.rows != rows:
            sl[:] = slots
            bt.take(sl, axis=0, out=tables)  # the ndarray methods: no numpy dispatch wrapper on this path
            self.slot_temperature.take(sl, out=a["temperature"])
            self.slot_top_p.take(sl, out=a["top_p"])
            self.slot_min_p.take(sl, out=a["min_p"])
            self.slot_top_k.take(sl, out=a["top_k"])
            self.slot_seed.take(sl, out=a["seeds"])
            pk.rows = rows
        # the K/V slots of positions n .. n+P-1 (what a step may commit; padding rows: the scratch block's)
        nc = a["num_cached"]
        ar = np.arange(P)
        flat_slots(tables, nc[:, None] + ar, self.block_size, pk.row_offsets, out=a["commit_slots"])
        if cat_tokens is not None:  # the catch-up pairs at positions d .. n-1: the draft's slots, positions, count
            lens = a["catchup_lens"]
            np.subtract(nc, a["num_draft_cached"], out=lens)
            pos = a["num_draft_cached"][:, None] + ar
            valid = ar < lens[:, None]
            a["catchup_slots"][:] = np.where(valid, flat_slots(tables, pos, self.block_size, pk.row_offsets), -1)
            a["catchup_positions"][:] = np.where(valid, pos, 0)
        pk.send()
        pk.inputs.max_context_len = self.context_bound(seqs) if self.use_triton and seqs else max(ncs)
        return pk.inputs

    def context_bound(self, seqs: list[Sequence]) -> int:
        """The max_context_len of a decode step of `seqs` on the Triton kernels, where it only steers the
        attention's split count: the context bucket (`eyas.engine.cuda_graph.context_bucket`) above the host's
        longest committed length plus the at most `lookahead` tokens a step still in flight commits. A graph and
        an eager step of the same sequences so choose the same splits, and compute the same."""
        from eyas.engine.cuda_graph import context_bucket
        return context_bucket(max(s.num_cached for s in seqs) + self.lookahead, self.width * self.block_size)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> tuple[list[list[int]], list[int]]:
        """One speculative step for all sequences (see `spec_step` for what each cache holds before and after).
        Returns (new tokens per sequence: accepted draft tokens + bonus, accepted draft tokens per sequence)."""
        return self.collect(self.launch(seqs))

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], after: StepHandle | None = None) -> StepHandle:
        """Enqueue one speculative step for `seqs` without waiting for it; `collect` reads it back.

        `after`: the step still in flight for the same sequences (overlapped decoding): this step's inputs are then
        derived on the device from its outputs (`eyas.spec.carry.carry_inputs`) instead of packed from the host's
        state, which does not know yet what that step accepted. The caller must have reserved KV blocks for two
        steps ahead (`Scheduler.reserve_ahead`)."""
        tree = self.tree_for(len(seqs), max(s.params.temperature for s in seqs))
        if self.bare_tree is not None and min(s.params.temperature for s in seqs) >= self.plain_from:
            tree = self.bare_tree  # plain decoding without the draft (`draft_for`)
        if self.proposer is not None:  # n-gram proposals from the committed tokens; none at all: a plain step
            if after is not None:
                raise ValueError("an n-gram step cannot be overlapped: its proposals need the step before's tokens")
            self._proposals = [self.proposer.propose_for(s, tree.num_nodes) for s in seqs]
            if all(p is None for p in self._proposals):
                tree = self.plain_tree
        self.tree_steps[tree.name] = self.tree_steps.get(tree.name, 0) + 1
        guide = self._guide(seqs)
        logprobs = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
        penalties, pen_slots = self._step_penalties(seqs)
        graphed = self.graphs is not None and self.graphs.can_run(seqs)
        if after is not None:
            if after.seqs != seqs or after.graphed != graphed or after.tree is not tree:
                raise ValueError("an overlapped step must follow a step of the same sequences")
            if guide is not None:
                raise ValueError("a guided step cannot be overlapped: its masks need the step before's commits")
            self._refresh_tables(seqs, after.B)
        graph_key = None
        if graphed and guide is not None:  # three graphs, the grammar masks made on the host in the middle
            graph_key, out = self.graphs.launch_guided(seqs, tree, guide, logprobs, penalties)
            B = graph_key[0]
        elif graphed and (logprobs is not None or penalties is not None):  # a graph of their own
            graph_key, out = self.graphs.launch_extras(seqs, tree, logprobs, penalties,
                                                       carried_from=None if after is None else after.graph_key)
            B = graph_key[0]
        elif graphed:
            graph_key, out = self.graphs.launch(seqs, tree, carried_from=None if after is None else after.graph_key)
            B = graph_key[0]
        else:
            B = len(seqs)
            if after is None:
                inp = self.decode_inputs(seqs)
            else:
                inp = self.packer(B).inputs
                from eyas.spec.carry import carry_inputs
                carry_inputs(inp, after.out, self.block_size, self.num_slots, self.use_triton)
                # S's num_cached <= the host's + the in-flight step's commits (at most `lookahead`)
                inp.max_context_len = (self.context_bound(seqs) if self.use_triton
                                       else max(s.num_cached for s in seqs) + self.lookahead)
            mode = sampling_mode([s.params for s in seqs])
            out = spec_step(self.target, self.draft_for(tree), tree, self.cache, self.draft_cache, inp, self.block_size,
                            self.use_triton, self.simulated_accept, mode == "greedy", self.draft_hidden, guide,
                            logprobs, penalties, filters=mode == "filtered")
        if penalties is not None:  # the counts gain this step's tokens on the device (`PenaltyState`)
            n = len(seqs)
            self.penalty_state.commit(pen_slots, out.path_tokens[:n], out.num_accepted[:n], out.bonus[:n],
                                      words=penalties.words is not None)
        host_logprobs = None
        if out.logprobs is not None:  # to the host behind the step (a successor's replay overwrites a graph's outputs)
            host_logprobs = out.logprobs if self.device.type != "cuda" else tuple(
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in out.logprobs)
        host, done = self.packer(B).readback(out.packed)  # `done` follows the log-probabilities' copies too
        return StepHandle(list(seqs), B, tree, graphed, out, host, done, graph_key, penalties is not None,
                          host_logprobs)

    def _step_penalties(self, seqs: list[Sequence]) -> tuple[Penalties | None, torch.Tensor | None]:
        """A decode step's penalties (None when no sequence asks for any), gathered from the slots' device rows
        (`PenaltyState`, allocated at the first such step; rows made from the host's tokens only where stale), and
        the sequences' slots on the device (where the step's `commit` counts its tokens)."""
        if not any(s.params.has_penalties for s in seqs):
            return None, None
        if self.penalty_state is None:
            self.penalty_state = PenaltyState(self.num_slots + 1, self.target.config.vocab_size, self.device)
        slots = torch.tensor([s.slot for s in seqs])
        if self.device.type == "cuda":  # through pinned memory: no synchronisation (an overlapped step's launch)
            slots = slots.pin_memory()
        slots = slots.to(self.device, non_blocking=True)
        return self.penalty_state.penalties(seqs, slots), slots

    def _guide(self, seqs: list[Sequence]):
        """The step's grammar masks when any of `seqs` is guided (`eyas.spec.grammar.TreeGuide`), else None. A
        gated grammar still closed needs none (`eyas.spec.grammar.unmasked`: its commit is cut at the gate)."""
        from eyas.spec.grammar import unmasked
        states = [None if unmasked(s.grammar, s.params.has_penalties) else s.grammar for s in seqs]
        if all(st is None for st in states):
            return None
        self.guided_steps += 1
        from eyas.spec.grammar import TreeGuide
        return TreeGuide(states, next(st for st in states if st is not None).words)

    def _grow_slot_tables(self, seqs: list[Sequence]) -> None:
        """Copy the blocks a sequence's table gained into its slot's host row (blocks are only appended while a
        sequence holds its slot), moving `slot_epoch` when any did."""
        bt, nblk = self.slot_block_tables, self.slot_num_blocks
        for s in seqs:
            i, table = s.slot, s.block_table
            k = len(table)
            if nblk[i] != k:
                j = nblk[i]
                bt[i, j:k] = table[j:k]
                nblk[i] = k
                self.slot_epoch += 1

    def _refresh_tables(self, seqs: list[Sequence], B: int) -> None:
        """Before an overlapped step: send the rows of block tables that grew (the blocks reserved ahead) to the
        device; nothing else of the packed inputs is touched (the rest is carried on the device)."""
        pk = self.packer(B)
        self._grow_slot_tables(seqs)
        sl = pk.np["slots"]
        rows = (tuple(sl.tolist()), self.slot_epoch)
        if pk.rows != rows:
            self.slot_block_tables.take(sl, axis=0, out=pk.np["block_tables"])
            pk.rows = rows
            pk.send(pk.span["block_tables"])

    def collect(self, h: StepHandle) -> tuple[list[list[int]], list[int]]:
        """Wait for a launched step and apply it to its sequences' host state (the one host synchronisation of the
        step: accepted counts, path tokens and bonus in one transfer; the accepted path's hidden states stay on the
        device, in the sequences' slots of `draft_hidden`). Returns (new tokens per sequence, accepted draft tokens
        per sequence); a sequence that finished while the step was in flight (overlapped decoding) gets [] and 0
        and its state is left alone."""
        if h.done is not None:
            h.done.synchronize()
        host = h.host[:len(h.seqs)].tolist()
        lps = h.host_logprobs
        m_host = []
        new_tokens = []
        with_draft = self.draft is not None
        draftless = with_draft and h.tree is self.bare_tree
        for s, row in zip(h.seqs, host):
            if s.finished:
                m_host.append(0)
                new_tokens.append([])
                continue
            m = row[0]
            m_host.append(m)
            new_tokens.append(row[2: m + 2] + [row[-1]])
            if lps is not None and s.params.logprobs is not None:
                s.new_logprobs = _entries(lps, len(new_tokens) - 1, s.params.logprobs, m + 1)
            if draftless and s.draft_valid is None:  # its draft cache is not written from here on
                s.draft_valid = s.num_draft_cached
            s.num_draft_cached = s.num_cached if with_draft else 0
            s.num_cached += m + 1
        if h.penalised:
            self.penalty_state.collect(h.seqs, new_tokens)
        return new_tokens, m_host


@dataclass(eq=False)
class StepHandle:
    """A decode step enqueued on the device (`ModelRunner.launch`), not yet read back (`ModelRunner.collect`)."""
    seqs: list[Sequence]
    B: int  # rows (the graph's bucket, or len(seqs))
    tree: Tree
    graphed: bool
    out: DecodeOutputs  # its device outputs (a graph's static ones: the next replay overwrites them)
    host: torch.Tensor  # out.packed as copied to the host (pinned on CUDA; complete once `done` has passed)
    done: torch.cuda.Event | None
    graph_key: tuple | None = None  # the replayed graph's (`GraphedStep.launch`)
    penalised: bool = False  # it applied penalties and counted its tokens on the device (`PenaltyState.commit`)
    host_logprobs: tuple | None = None  # out.logprobs as copied to the host (complete once `done` has passed)
