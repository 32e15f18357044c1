"""CUDA graphs of the prefill's target forward, per (batch bucket, chunk-length bucket, context bucket).

A prompt's prefill is one forward of the target over its tokens: some 11 kernels a layer. Run eagerly, the host
launches them one by one, and on a small model it is the host that sets the pace: SmolLM2's prefill kept the GPU
busy 0.9-2.5 ms of its 18-24 ms at batch 1 (session 61, `tools/diag/prefill_cost.py` on an H100). A graph replays
the whole forward in one launch: 1.4-3.0 ms.

Graphs need fixed shapes, so on a GPU a prefill chunk of B sequences and Q tokens runs at a padded shape
(`prefill_shape`): B up to a batch bucket and Q up to a token bucket (16-token steps up to 128, then about a quarter
of the length, so at most 25% more rows). Padded rows have no tokens (`lens` 0): their positions write no K/V and no
real row attends to them. The shape is a function of (B, Q) alone, and the eager forward pads the same way on a GPU,
so a graphed prefill computes exactly what an eager one does (the kernels' choices, cuBLAS's included, follow the
shapes). Likewise the attention's split count follows a context bucket (`eyas.engine.cuda_graph.context_bucket`) of
the chunk's longest prefix in both, and 0 for a first chunk without a cached prefix.

`prefill_forward` is the forward from the packed inputs: the eager reference the graphs replay, and what runs where no
graph is kept (a shape past the buckets, or more than MAX_GRAPHS). The graphs are captured when first needed, into a
pool of their own (a decode graph's outputs may be awaiting their read-back when a prefill runs), or all at once
ahead of time (`capture_all`: `eyas serve` and `eyas bench latency` do). tests/test_prefill_graph.py holds a padded
prefill to a dense forward (CPU) and the graphed prefill to the eager one, to the bit (GPU).
"""
from __future__ import annotations

import torch

from eyas.layers.attention import MetaBuilder
from eyas.spec.drafter import causal_mask

BATCH_BUCKETS = (1, 2, 4, 8, 16)
TOKEN_BUCKETS = (tuple(range(16, 129, 16)) + tuple(range(160, 257, 32)) + tuple(range(320, 513, 64))
                 + tuple(range(640, 1025, 128)) + tuple(range(1280, 2049, 256)))
GRAPH_TOKENS = 2048  # a graph's padded batch x length at most
MAX_GRAPHS = 128  # graphs kept; further shapes run eagerly (at the same padded shapes)


def prefill_shape(B: int, Q: int) -> tuple[int, int] | None:
    """The padded (batch, length) of a prefill chunk of B sequences and at most Q tokens each, or None where it runs
    at its own shape (past the buckets, or more than GRAPH_TOKENS padded tokens)."""
    b = next((x for x in BATCH_BUCKETS if x >= B), None)
    q = next((x for x in TOKEN_BUCKETS if x >= Q), None)
    if b is None or q is None or b * q > GRAPH_TOKENS:
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


class PrefillGraphs:
    """The prefill graphs of a runner, keyed (padded batch, padded length, context bound)."""

    def __init__(self, runner):
        self.runner = runner
        # key -> (graph, static packed inputs (`pack`), (hidden, features): views of the shared outputs)
        self.graphs: dict[tuple[int, int, int], tuple] = {}
        self.pool = None
        self._buffers: tuple[torch.Tensor, ...] | None = None  # the outputs' (`_outputs`)

    @torch.inference_mode()
    def capture_all(self, max_batch: int, max_len: int) -> int:
        """Capture, ahead of time, the graph of every padded shape that a chunk of up to `max_batch` sequences of up
        to `max_len` tokens each, without a cached prefix, can take (a chunk after a cached prefix is captured when
        first seen). Returns how many were captured."""
        top_b = next((b for b in BATCH_BUCKETS if b >= max_batch), BATCH_BUCKETS[-1])
        top_q = next((q for q in TOKEN_BUCKETS if q >= max_len), TOKEN_BUCKETS[-1])
        new = 0
        for b in BATCH_BUCKETS:
            for q in TOKEN_BUCKETS:
                key = (b, q, 0)
                if b > top_b or q > top_q or b * q > GRAPH_TOKENS or key in self.graphs:
                    continue
                if len(self.graphs) >= MAX_GRAPHS:
                    return new
                self.graphs[key] = self._capture(key, self.size(b, q))
                new += 1
        return new

    def size(self, B: int, Q: int) -> int:
        """The numel of `pack`'s inputs of B rows of Q tokens with the runner's block-table width."""
        return B * (Q + 2 + self.runner.width)

    def run(self, packed: torch.Tensor, key: tuple[int, int, int]):
        """(hidden, features) of the chunk whose packed inputs (`pack`) are `packed` (on the host), from the graph of
        `key` (captured now if it is new): views of the shared output buffers, valid until the next replay. None
        where no graph is kept (MAX_GRAPHS)."""
        g = self.graphs.get(key)
        if g is None:
            if len(self.graphs) >= MAX_GRAPHS:
                return None
            g = self.graphs[key] = self._capture(key, packed.numel())
        graph, static, out = g
        static.copy_(packed)
        graph.replay()
        return out

    def forward(self, static: torch.Tensor, key):
        r = self.runner
        B, Q, context = key
        ids, start, lens, tables = unpack(static, B, Q)
        return prefill_forward(r.target, r.cache, ids, start, lens, tables, r.block_size, context, r.use_triton,
                               getattr(r.draft, "feature_layers", None))

    def _capture(self, key, size: int):
        """Warm up and capture the forward of `key` on inputs of padding alone (no tokens: nothing written but the
        scratch slot); `size`: the packed inputs' numel. The graph ends by copying its outputs into views of the
        shared output buffers (`_outputs`), so that its own return its memory to the pool."""
        B, Q, _ = key
        static = torch.zeros(size, dtype=torch.long, device=self.runner.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warm = self.forward(static, key)  # compile the Triton kernels and warm the allocator outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        outs = self._outputs(warm, B, Q)
        del warm
        graph = torch.cuda.CUDAGraph()
        # thread-local error mode, as the decode graphs (`GraphedStep._capturing`): a disaggregated engine's other
        # thread may be working on the GPU
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden, feats = self.forward(static, key)
            outs[0].copy_(hidden)
            if outs[1] is not outs[0]:
                outs[1].copy_(feats)
            del hidden, feats
        self.pool = graph.pool()
        return graph, static, outs

    def _outputs(self, like, B: int, Q: int):
        """Views [B, Q, ...] of the output buffers every graph shares (GRAPH_TOKENS rows of the hidden state and of
        the features, made at the first capture, outside the pool): held per graph, the outputs of a server's ~80
        graphs would take ~0.4 GB on SmolLM2 and gigabytes on an 8B model. One prefill's outputs are read before the
        next replays."""
        hidden, feats = like
        if self._buffers is None:
            self._buffers = tuple(torch.empty(GRAPH_TOKENS, x.shape[-1], dtype=x.dtype, device=x.device)
                                  for x in ((hidden,) if feats is hidden else (hidden, feats)))
        views = tuple(b[: B * Q].view(B, Q, -1) for b in self._buffers)
        return views if len(views) == 2 else views * 2


def pack(rows: list[list[int]], start: list[int], lens: list[int], tables: list[list[int]], B: int, Q: int,
         width: int) -> torch.Tensor:
    """One flat int64 host tensor of a chunk's inputs, each part contiguous (kernels take their rows by pointer):
    tokens [B, Q], start [B], lens [B], block tables [B, width]. Rows past len(rows) are padding: no tokens, an
    empty table."""
    out = torch.zeros(B * (Q + 2 + width), dtype=torch.long)
    ids, st, ln, tb = unpack(out, B, Q)
    for i, (r, s, n, t) in enumerate(zip(rows, start, lens, tables)):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        st[i], ln[i] = s, n
        tb[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    return out


def unpack(packed: torch.Tensor, B: int, Q: int):
    """(ids [B, Q], start [B], lens [B], block tables [B, width]): contiguous views of `pack`'s layout."""
    width = packed.numel() // B - Q - 2
    ids, start, lens, tables = packed.split([B * Q, B, B, B * width])
    return ids.view(B, Q), start, lens, tables.view(B, width)
