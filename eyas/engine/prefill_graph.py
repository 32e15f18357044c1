"""CUDA graphs of the prefill: the target's forward, its last tokens' logits and the draft's reading of the chunk, per
(batch bucket, chunk-length bucket, with or without a cached prefix).

A prompt's prefill is one forward of the target over its tokens: some 11 kernels a layer. Run eagerly, the host
launches them one by one, and on a small model it is the host that sets the pace: SmolLM2's prefill kept the GPU
busy 0.9-2.5 ms of its 18-24 ms at batch 1 (session 61, `tools/diag/prefill_cost.py` on an H100). A graph replays
the whole forward in one launch: 1.4-3.0 ms.

Graphs need fixed shapes, so on a GPU a prefill chunk of B sequences and Q tokens runs at a padded shape
(`prefill_shape`): B up to a batch bucket and Q up to a token bucket (16-token steps up to 128, then about a quarter
of the length, so at most 25% more rows). Padded rows have no tokens (`lens` 0): their positions write no K/V and no
real row attends to them. The shape is a function of (B, Q) and of the target's limit on padded tokens
(`graph_tokens`), and the eager forward pads the same way on a GPU, so a graphed prefill computes exactly what an
eager one does (the kernels' choices, cuBLAS's included, follow the shapes). Likewise the attention's split count
follows `prefill_context` in both: chosen for no prefix in a first chunk, and for the block tables' whole width in a
chunk after a cached prefix of any length.

`prefill_step` is the step from the packed inputs: the target's forward (`prefill_forward`), the logits at each row's
last token (`last_logits`), the first tokens drawn from them (`first_tokens`) and the draft's reading of the chunk
(`draft_read`, on the device: the host's `ModelRunner._draft_prefill` formulated without host loops), the eager
reference the graphs replay, and what runs where no graph is kept (more than MAX_GRAPHS) or its capture failed. A
shape past the buckets runs eagerly at its own shape, the draft after it on the host. The graphs are captured when
first needed, into a pool of their own (a decode graph's outputs may be awaiting their read-back when a prefill
runs), or all at once ahead of time, with and without a prefix (`capture_all`: `eyas serve` and `eyas bench latency`
do).
tests/test_prefill_graph.py holds a padded prefill to a dense forward, and an engine's padded prefills
(`ModelRunner.pad_prefill`) to unpadded ones: tokens, acceptance, log-probabilities, caches and the draft's waiting
features (CPU); and the graphed step to the eager one, to the bit (GPU).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from eyas.engine.cuda_graph import capturing
from eyas.layers.attention import MetaBuilder
from eyas.spec.drafter import causal_mask

log = logging.getLogger("eyas")

BATCH_BUCKETS = (1, 2, 4, 8, 16)
TOKEN_BUCKETS = (tuple(range(16, 129, 16)) + tuple(range(160, 257, 32)) + tuple(range(320, 513, 64))
                 + tuple(range(640, 1025, 128)) + tuple(range(1280, 2049, 256)))
# a graph's padded batch x length at most (`graph_tokens`): larger on small models. Padding a chunk to its bucket
# costs compute (a batch of 9 runs as 16), which a small model's GPU time hardly notices and a large model's would:
# SmolLM2's MT-Bench waves of 16 (1,200-3,100 tokens) prefilled eagerly at 2,048 and from graphs at 8,192: TTFT
# 24.7 -> 14.9 ms plain and 31.9 -> 18.1 ms with the default tree (session 62, calls 11-12, H100), for
# 108 prefill graphs in 10.1 s and 768 MiB where 2,048 had 80 in 5.6 s and 548 MiB (calls 1 and 13). Above a
# billion parameters it stays 2,048: the 8B shape's waves of 9 and 16 prompts of 300 tokens took TTFT 80.9 and
# 143.1 ms at 2,048 (eager, own shape) against 88.6 and 149.7 ms from graphs at 8,192 (session 63, call 2, H100)
GRAPH_TOKENS = 2048
SMALL_GRAPH_TOKENS = 8192
SMALL_MODEL = 10**9  # parameters
FIELDS = 6  # `pack`'s fields of one word a sequence (start, lens, slots, draft starts, seeds, temperatures)
MAX_GRAPHS = 256  # graphs kept; further shapes run eagerly (at the same padded shapes)
# the draft reads a padded chunk in the prefill's own step (`draft_read`, inside its graph), not after it on the host
# (`ModelRunner._draft_prefill`, which costs the default tree 1.8-2.7 ms of its 3.9-6.7 ms TTFT on an H100: on in
# session 62, whose call 1 timed 16-1,024-token prompts at 1.8-3.6 ms with it). False: the host's catch-up after it
DRAFT_IN_PREFILL = True
# replay each graph once right after its capture, on the padding it was captured on, so that a request's prefill is
# not a graph's first launch (by CUDA's documentation, a launch uploads a graph not uploaded before; not profiled).
# On since session 63: over 8 shapes, a graph's first TTFT was 0.42-0.47 ms longer on average than its next ones
# (1.85-1.89 against 1.42-1.43 ms), and 1.43 against 1.41 with the replay, for 1.24 s of capture against 1.18 s
# (32 graphs; SmolLM2-shape, the default tree, H100, call 14, tools/diag/first_replay.py). On a large target each
# such replay is a whole padded prefill at startup (the 8B shape's: not measured)
WARM_REPLAY = True


def graph_tokens(model: torch.nn.Module) -> int:
    """The most padded tokens (batch x length) a prefill graph of this target takes: SMALL_GRAPH_TOKENS under
    SMALL_MODEL parameters, else GRAPH_TOKENS."""
    small = sum(p.numel() for p in model.parameters()) < SMALL_MODEL
    return SMALL_GRAPH_TOKENS if small else GRAPH_TOKENS


def prefill_context(longest_prefix: int, width_tokens: int) -> int:
    """The context bound that a padded prefill chunk's attention splits are chosen for, and its graph is keyed by: 0
    for a chunk without a cached prefix, else the block tables' whole width (`width_tokens`), whatever the prefix's
    length. So one graph a padded shape serves every chunk after a prefix (a chat's later turns after a prefix-cache
    hit, a long prompt's later chunks), and `capture_all` captures it ahead with the first chunks' graph; the
    prefix kernel's splits that hold no keys of a shorter prefix return at once."""
    return 0 if longest_prefix == 0 else width_tokens


def prefill_shape(B: int, Q: int, limit: int = GRAPH_TOKENS) -> tuple[int, int] | None:
    """The padded (batch, length) of a prefill chunk of B sequences and at most Q tokens each, or None where it runs
    at its own shape (past the buckets, or more than `limit` padded tokens: `graph_tokens`)."""
    b = next((x for x in BATCH_BUCKETS if x >= B), None)
    q = next((x for x in TOKEN_BUCKETS if x >= Q), None)
    if b is None or q is None or b * q > limit:
        return None
    return b, q


def prefill_forward(target, cache, ids, start, lens, block_tables, block_size: int, max_context_len: int,
                    use_triton: bool, feature_layers=None):
    """The target's forward over a prefill chunk: sequence b's tokens ids[b, :lens[b]] at positions start[b]..,
    their K/V written to the cache through block_tables (no writes past lens[b]). Returns (hidden, features) [B, Q,
    ...] (features is hidden without `feature_layers`)."""
    Q = ids.shape[1]
    ar = torch.arange(Q, device=ids.device)[None, :]
    valid = ar < lens[:, None]
    meta = MetaBuilder(block_tables, block_size, max_context_len, use_triton)
    m = meta(start, causal_mask(lens, Q), slot_mapping=meta.slots(start[:, None] + ar, valid))
    positions = torch.where(valid, start[:, None] + ar, 0)
    if feature_layers is None:
        hidden = target(ids, positions, m, cache)
        return hidden, hidden
    return target(ids, positions, m, cache, feature_layers=feature_layers)


def draft_read(draft, target, draft_cache, draft_hidden, feats, ids, start, lens, slots, draft_start, block_tables,
               block_size: int, max_context_len: int, use_triton: bool) -> None:
    """The draft reads the pairs (x_{t+1}, h_t) a prefill chunk made known, from the target's features [B, Q, ...] of
    `prefill_forward`, on the device alone (so inside a graph too): `ModelRunner._draft_prefill`'s work for chunks
    that begin where the draft stands (a first chunk: draft_start == start; it reads lens - 1 pairs, the last
    position's h waiting) or one behind it (a later chunk: the waiting h of the previous chunk's end first, then
    lens pairs). Writes the draft's K/V, and each row's last h to draft_hidden[slots, 0]. Padding rows (lens 0) read
    nothing; their slot is the scratch slot."""
    from eyas.spec.drafter import catch_up
    read = draft.read_features(feats)
    first = draft_start == start
    waiting = draft_hidden[slots, 0].to(read.dtype)
    pairs_h = torch.where(first[:, None, None], read, torch.cat([waiting[:, None], read[:, :-1]], 1))
    tokens = torch.where(first[:, None], torch.roll(ids, -1, 1), ids)
    n = (lens - first.long()).clamp(min=0)
    meta = MetaBuilder(block_tables, block_size, max_context_len, use_triton)
    catch_up(draft, target, draft_cache, tokens, pairs_h, n, draft_start, meta)
    last = (lens - 1).clamp(min=0)
    draft_hidden[slots, 0] = read[torch.arange(len(lens), device=read.device), last].to(draft_hidden.dtype)


def last_logits(target, hidden: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """[B, V] float32: the target's logits at each row's last token (hidden [B, Q, H]; a padding row, lens 0, reads
    its first position), from which the prefill draws the first token."""
    rows = torch.arange(len(lens), device=lens.device)
    return target.compute_logits(hidden[rows, (lens - 1).clamp(min=0)])


def first_tokens(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                 use_triton: bool, tau: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens after the prompts, as a decode step draws its bonus: an exponential race on the logits [B, V]
    (`race_sample`; rows of temperature 0 the argmax) at the counters of the prompts' last positions, among the
    tokens at or above `tau` [B] (the filters' threshold) where given."""
    from eyas.layers.sampler import RACE_BASE, race_for
    return race_for(use_triton)(logits, temperature, seeds, counters, torch.full_like(counters, RACE_BASE), tau=tau)


def prefill_step(runner, packed: torch.Tensor, B: int, Q: int, context: int, with_draft: bool):
    """A chunk's target forward (`prefill_forward`), its last tokens' logits (`last_logits`) and the first tokens
    drawn from them as they are (`first_tokens`: the prefill takes them where no grammar, penalty or filter changes
    the logits) and, `with_draft`, the draft's reading of the chunk (`draft_read`), from `pack`'s inputs on the
    device: what a prefill graph replays, and the eager path at the same shapes. Returns (hidden, features, logits,
    first tokens)."""
    r = runner
    ids, start, lens, slots, dstart, seeds, temps, tables = unpack(packed, B, Q)
    hidden, feats = prefill_forward(r.target, r.cache, ids, start, lens, tables, r.block_size, context, r.use_triton,
                                    getattr(r.draft, "feature_layers", None))
    if with_draft:
        draft_read(r.draft, r.target, r.draft_cache, r.draft_hidden, feats, ids, start, lens, slots, dstart, tables,
                   r.block_size, context, r.use_triton)
    logits = last_logits(r.target, hidden, lens)
    first = first_tokens(logits, temps.float(), seeds, start + lens - 1, r.use_triton)
    return hidden, feats, logits, first


class PrefillGraphs:
    """The prefill graphs of a runner, keyed (padded batch, padded length, context bound, with the draft's reading)."""

    def __init__(self, runner):
        self.runner = runner
        # key -> (graph, static packed inputs (`pack`), (hidden, features, logits, first tokens): views of the
        # shared outputs, `_outputs`)
        self.graphs: dict[tuple[int, int, int, bool], tuple] = {}
        self.pool = None
        self._buffers: tuple[torch.Tensor, ...] | None = None  # the outputs' (`_outputs`)
        # keys whose capture, when first seen, failed: run eagerly at the same shape since. A capture invalidated by
        # an operation leaves the device usable; an error that does not would fail the eager step too, as before.
        # (Session 62 saw one capture error in a GPU test, once in five runs, cause unknown)
        self.failed: set[tuple[int, int, int, bool]] = set()
        self._stage: torch.Tensor | None = None  # pinned: the packed inputs on their way to a graph's (`_send`)
        self._copied = None  # a CUDA event after the last copy out of it

    @torch.inference_mode()
    def capture_all(self, max_batch: int, max_len: int, progress=None) -> int:
        """Capture, ahead of time, the graph of every padded shape that a chunk of up to `max_batch` sequences of up
        to `max_len` tokens each can take: without a cached prefix, then after one (`prefill_context`), so that
        neither a first request nor a chat's next turn pays a capture (at most MAX_GRAPHS in all). `progress`: a
        tqdm bar, whose total grows by the graphs to capture and which advances as they are. Returns how many were
        captured."""
        r = self.runner
        with_draft = DRAFT_IN_PREFILL and r.draft is not None
        top_b = next((b for b in BATCH_BUCKETS if b >= max_batch), BATCH_BUCKETS[-1])
        top_q = next((q for q in TOKEN_BUCKETS if q >= max_len), TOKEN_BUCKETS[-1])
        keys = [(b, q, context, with_draft) for context in (0, prefill_context(1, r.width * r.block_size))
                for b in BATCH_BUCKETS if b <= top_b for q in TOKEN_BUCKETS if q <= top_q
                if prefill_shape(b, q, r.prefill_tokens) is not None]
        keys = [k for k in keys if k not in self.graphs][:max(0, MAX_GRAPHS - len(self.graphs))]
        if progress is not None:
            progress.total = (progress.total or 0) + len(keys)
            progress.refresh()
        for key in keys:
            self.graphs[key] = self._capture(key)
            if progress is not None:
                progress.update(1)
        return len(keys)

    def run(self, packed: torch.Tensor, key: tuple[int, int, int, bool]):
        """(hidden, features, logits, first tokens) of the chunk whose packed inputs (`pack`) are `packed` (on the
        host), from the graph of `key` (captured now if it is new): views of the shared output buffers, valid until
        the next replay. None where no graph is kept (MAX_GRAPHS) or its capture failed: the caller runs the step
        eagerly."""
        g = self.graphs.get(key)
        if g is None:
            if len(self.graphs) >= MAX_GRAPHS or key in self.failed:
                return None
            try:
                g = self._capture(key)
            except RuntimeError as e:  # (torch.AcceleratorError is one) the request goes on, eagerly
                self.failed.add(key)
                log.warning("prefill graph %s could not be captured, so that shape runs eagerly: %s", key, e)
                return None
            self.graphs[key] = g
        graph, static, out = g
        self._send(static, packed)
        graph.replay()
        return out

    def _send(self, static: torch.Tensor, packed: torch.Tensor) -> None:
        """static <- packed (host) without the host waiting for the stream: a plain copy from ordinary memory
        synchronises with it, and so waits for a decode step in flight (overlapped decoding) before the prefill is
        even enqueued. On CUDA the inputs go through a pinned staging buffer, written once the copy out of it before
        is done (an event; the prefill's read-back has waited for it already)."""
        if not static.is_cuda:
            static.copy_(packed)
            return
        n = packed.numel()
        if self._copied is None:
            self._copied = torch.cuda.Event()
        else:
            self._copied.synchronize()
        if self._stage is None or self._stage.numel() < n:  # (once: sized for the largest chunk a graph takes)
            r = self.runner
            most = r.prefill_tokens + BATCH_BUCKETS[-1] * (FIELDS + r.width)
            self._stage = torch.empty(max(n, most), dtype=packed.dtype, pin_memory=True)
        stage = self._stage[:n]
        stage.copy_(packed)
        static.copy_(stage, non_blocking=True)
        self._copied.record()

    def forward(self, static: torch.Tensor, key):
        B, Q, context, with_draft = key
        return prefill_step(self.runner, static, B, Q, context, with_draft)

    def _capture(self, key):
        """Warm up and capture the step of `key` on inputs of padding alone (no tokens, the scratch slot: nothing
        written but the scratch block and slot). The graph ends by copying its outputs into views of the shared
        output buffers (`_outputs`), so that its own return their memory to the pool."""
        r = self.runner
        B, Q = key[:2]
        static = pack([], [], [], [], B, Q, r.width, pad_slot=r.num_slots).to(r.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warm = self.forward(static, key)  # compile the Triton kernels and warm the allocator outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        outs = self._outputs(warm, B, Q)
        del warm
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self.pool):  # as the decode graphs' (thread-local errors, no collection under way)
            hidden, feats, logits, first = self.forward(static, key)
            outs[0].copy_(hidden)
            if outs[1] is not outs[0]:
                outs[1].copy_(feats)
            outs[2].copy_(logits)
            outs[3].copy_(first)
            del hidden, feats, logits, first
        self.pool = graph.pool()
        if WARM_REPLAY:  # on the padding it was captured on: writes the scratch block and slot, as the warm-up did
            graph.replay()
        return graph, static, outs

    def _outputs(self, like, B: int, Q: int):
        """Views of the output buffers every graph shares, made at the first capture, outside the pool: the hidden
        state's and the features' [B, Q, ...] (`prefill_tokens` rows each; one buffer and the same view twice
        without features), the logits' [B, V] and the first tokens' [B] (the largest batch bucket's rows). Held per
        graph, the outputs of a server's ~100 graphs would take ~0.5 GB on SmolLM2 and gigabytes on an 8B model (by
        their sizes; not measured). One prefill's outputs are read before the next replays."""
        hidden, feats, logits, first = like
        if self._buffers is None:
            states = tuple(torch.empty(self.runner.prefill_tokens, x.shape[-1], dtype=x.dtype, device=x.device)
                           for x in ((hidden,) if feats is hidden else (hidden, feats)))
            top = BATCH_BUCKETS[-1]
            self._buffers = states + (logits.new_empty(top, logits.shape[-1]), first.new_empty(top))
        *states, logits, first = self._buffers
        views = tuple(b[: B * Q].view(B, Q, -1) for b in states)
        return (views if len(views) == 2 else views * 2) + (logits[:B], first[:B])


def pack(rows: list[list[int]], start: list[int], lens: list[int], tables: list[list[int]], B: int, Q: int,
         width: int, slots: list[int] | None = None, draft_start: list[int] | None = None, pad_slot: int = 0,
         seeds: list[int] | None = None, temperatures: list[float] | None = None) -> torch.Tensor:
    """One flat int64 host tensor of a chunk's inputs, each part contiguous (kernels take their rows by pointer):
    tokens [B, Q], start [B], lens [B], the draft's slots [B] (`ModelRunner.draft_hidden` rows) and starts [B]
    (`Sequence.num_draft_cached`), the sequences' seeds [B] and temperatures [B] (float64 bits: the first token's
    draw, `first_tokens`), block tables [B, width]. Rows past len(rows) are padding: no tokens, an empty table, the
    slot `pad_slot` (the runner's scratch slot), temperature 0. Written through numpy: torch's element writes took
    0.36-0.49 ms at B = 16 (130-300 tokens a row) on this repository's CPU, numpy's 0.04-0.08 (session 62,
    `tools/diag/pack_cost.py`)."""
    out = np.zeros(B * (Q + FIELDS + width), dtype=np.int64)
    ids, tb = out[: B * Q].reshape(B, Q), out[B * (Q + FIELDS):].reshape(B, width)  # `unpack`'s layout
    st, ln, sl, ds, sd, tp = (out[B * (Q + k): B * (Q + k + 1)] for k in range(FIELDS))
    for i, (r, t) in enumerate(zip(rows, tables)):
        ids[i, : len(r)] = r
        tb[i, : len(t)] = t
    st[: len(start)], ln[: len(lens)] = start, lens
    sl[:] = pad_slot
    if slots is not None:
        sl[: len(slots)] = slots
    if draft_start is not None:
        ds[: len(draft_start)] = draft_start
    if seeds is not None:
        sd[: len(seeds)] = seeds
    if temperatures is not None:
        tp.view(np.float64)[: len(temperatures)] = temperatures
    return torch.from_numpy(out)


def unpack(packed: torch.Tensor, B: int, Q: int):
    """(ids [B, Q], start [B], lens [B], slots [B], draft starts [B], seeds [B], temperatures [B] float64, block
    tables [B, width]): contiguous views of `pack`'s layout."""
    width = packed.numel() // B - Q - FIELDS
    ids, start, lens, slots, dstart, seeds, temps, tables = packed.split([B * Q] + [B] * FIELDS + [B * width])
    return ids.view(B, Q), start, lens, slots, dstart, seeds, temps.view(torch.float64), tables.view(B, width)
