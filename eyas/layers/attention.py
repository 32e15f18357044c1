"""Split tree attention, in plain PyTorch (the reference every fast kernel is held to).

Every forward step of eyas (prefill chunk, plain decode, tree verification, draft level) has the same shape: each of
B sequences brings Q new tokens (padded). A new token attends to

* the **prefix**: the sequence's committed KV in the paged cache, `context_lens[b]` entries, with no mask; and
* the **suffix**: the step's own tokens (plus, for draft tree levels, earlier tree tokens) under `suffix_mask`
  (causal for prefill, the tree's ancestor mask for verification).

The two parts are computed separately, each returning its output and log-sum-exp, and merged exactly:
`lse = logaddexp(lse_p, lse_s)`, `o = o_p * exp(lse_p - lse) + o_s * exp(lse_s - lse)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What the runner tells every attention layer about one step. Shapes: B sequences, Q new tokens each."""

    block_tables: torch.Tensor  # [B, max_blocks] int64, block ids of each sequence in the paged cache
    context_lens: torch.Tensor  # [B] int64, committed entries each new token attends to without mask
    suffix_mask: torch.Tensor  # [B, Q, P + Q] bool, visibility among past tree tokens (P) and new tokens (Q)
    max_context_len: int  # host-side bound on context_lens (prefix gather width)
    block_size: int
    slot_mapping: torch.Tensor | None = None  # [B, Q] int64: cache slots for new K/V; None: do not write
    # tree tokens: their K/V go to the step's stash, never to the cache (`Stash`); None: no stash
    stash: "Stash | None" = None
    stash_at: int = 0  # the stash row of this forward's first token (a node index)
    suffix_from: int = 0  # the first stash row the suffix attends to (earlier tree tokens, then these Q)
    use_triton: bool = False  # the Triton kernels of eyas.kernels instead of this reference (CUDA)
    # plain decoding (one new token that is always kept): its K/V go to the cache first and the prefix pass, over
    # context_lens entries that include it, is the whole attention (no suffix pass, no merge)
    prefix_includes_new: bool = False


@dataclass
class Stash:
    """The K/V of one step's tree tokens, for every layer: k and v [L, B, R, KVH, D], row r of sequence b for tree
    node r. A forward's layer l stores its Q tokens' K/V at rows stash_at .. stash_at+Q-1 (the fused RoPE kernel
    writes them there directly) and its suffix attends to rows suffix_from .. stash_at+Q-1, so the levels of a tree
    need no concatenation. After verification the accepted rows go to the cache, all layers in one launch."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def like(cls, cache, batch: int, rows: int) -> "Stash":
        """A stash for `rows` tree nodes of `batch` sequences, shaped and typed after a KVCache."""
        L, _, _, KVH, D = cache.k.shape
        shape = (L, batch, rows, KVH, D)
        return cls(torch.empty(shape, dtype=cache.k.dtype, device=cache.k.device),
                   torch.empty(shape, dtype=cache.v.dtype, device=cache.v.device))


@dataclass
class MetaBuilder:
    """What stays fixed across the forwards of one step (block tables, backend); builds each forward's metadata."""

    block_tables: torch.Tensor
    block_size: int
    max_context_len: int
    use_triton: bool = False

    def __call__(self, context_lens, suffix_mask, max_context_len: int | None = None, **kw) -> AttentionMetadata:
        bound = self.max_context_len if max_context_len is None else max_context_len
        return AttentionMetadata(block_tables=self.block_tables, context_lens=context_lens, suffix_mask=suffix_mask,
                                 max_context_len=bound, block_size=self.block_size, use_triton=self.use_triton, **kw)

    def slots(self, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return slots_for(self.block_tables, positions, valid, self.block_size)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """Masked attention with log-sum-exp, GQA-aware, in float32.

    q [B, Q, H, D], k/v [B, L, KVH, D], mask [B, Q, L] bool -> o [B, Q, H, D] (float32), lse [B, Q, H].
    A row that sees nothing gets o = 0 and lse = -inf, so that it drops out of a merge.
    """
    B, Q, H, D = q.shape
    KVH = k.shape[2]
    G = H // KVH
    qg = q.float().view(B, Q, KVH, G, D)
    s = torch.einsum("bqkgd,blkd->bkgql", qg, k.float()) * scale  # [B, KVH, G, Q, L]
    s = s.masked_fill(~mask[:, None, None, :, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("bkgql,blkd->bqkgd", p / l.clamp_min(1e-30), v.float()).reshape(B, Q, H, D)
    lse = (m + torch.log(l)).squeeze(-1)  # [B, KVH, G, Q]; log(0) = -inf
    lse = lse.permute(0, 3, 1, 2).reshape(B, Q, H)
    return o, lse


def merge_attention(o1, lse1, o2, lse2):
    """Exact merge of two attention results over disjoint key sets."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


def gather_prefix(cache: torch.Tensor, block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The first `length` entries of each sequence's paged cache: [B, length, KVH, D]."""
    nb = -(-length // block_size)
    return cache[block_tables[:, :nb]].flatten(1, 2)[:, :length]


def prefix_attention(q, k_cache, v_cache, block_tables, context_lens, max_context_len, block_size, scale):
    """Attention of every new token over its sequence's committed KV (no mask beyond the length)."""
    B, Q, H, D = q.shape
    L = min(max(int(max_context_len), 1), block_tables.shape[1] * block_size)  # a bound never past the table
    k = gather_prefix(k_cache, block_tables, L, block_size)
    v = gather_prefix(v_cache, block_tables, L, block_size)
    valid = torch.arange(L, device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    return attend(q, k, v, valid[:, None, :].expand(B, Q, L), scale)


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Store new K/V [B, Q, KVH, D] at flat cache slots [B, Q]. Slots < 0 are not stored: they go to slot 0 of the
    scratch block 0, which no sequence reads (static shapes, so this also runs inside a CUDA graph)."""
    store_rows(k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:]), k, v, rows=slot_mapping)


def store_rows(k_dst, v_dst, k, v, rows=None, seq_rows=None, row_offset=0) -> None:
    """Store K/V [B, Q, KVH, D] into the row stores k_dst/v_dst [R, KVH, D] (a cache layer's flat slots, or a
    stash's b * R + node rows), in their dtype: token (b, j) at rows[b, j], or without `rows` at
    b * seq_rows + row_offset + j. Rows < 0 go to row 0, the scratch slot a paged cache never reads (as `write_kv`;
    the Triton kernel skips them). No host synchronisation."""
    if rows is None:
        B, Q = k.shape[:2]
        for src, dst in ((k, k_dst), (v, v_dst)):
            dst[: B * seq_rows].view(B, seq_rows, *dst.shape[1:])[:, row_offset: row_offset + Q] = src.to(dst.dtype)
        return
    r = rows.reshape(-1).clamp(min=0)
    k_dst[r] = k.reshape(-1, *k.shape[2:]).to(k_dst.dtype)
    v_dst[r] = v.reshape(-1, *v.shape[2:]).to(v_dst.dtype)


def slots_for(block_tables: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, block_size: int):
    """Flat cache slots of positions [B, Q] through each sequence's block table; -1 where not valid."""
    blk = block_tables.gather(1, (positions // block_size).clamp(0, block_tables.shape[1] - 1))
    return torch.where(valid, blk * block_size + positions % block_size, torch.full_like(positions, -1))


def prefix_only_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out_dtype=torch.float32,
                          pdl: bool = False):
    """The prefix pass alone ([B, Q, H, D]; float32 in the reference, `out_dtype` from the kernel): for
    `meta.prefix_includes_new`, where the new tokens' K/V are already in the cache and `context_lens` counts them.
    `pdl`: the kernels' programmatic dependent launch, where `eyas.kernels.tree_attention.PDL` allows it."""
    if meta.use_triton:
        from eyas.kernels import paged_prefix_attention
        return paged_prefix_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      max_context_len=meta.max_context_len, out_dtype=out_dtype, pdl=pdl)[0]
    return prefix_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.max_context_len,
                            meta.block_size, scale)[0]


def split_tree_attention(q, k_new, v_new, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                         out_dtype=torch.float32, pdl: bool = False):
    """Prefix part (paged, no mask) + suffix part (tree mask), merged by log-sum-exp. k_new/v_new [B, L, KVH, D] are
    the suffix keys: the Q new tokens, after any earlier tree tokens (L = P + Q, `meta.suffix_mask` [B, Q, L]).
    Returns [B, Q, H, D]: float32 in the reference, `out_dtype` from the kernels (the model's dtype: no cast
    follows). `pdl`: as `prefix_only_attention`'s."""
    if meta.use_triton:
        from eyas.kernels import split_tree_attention_triton
        return split_tree_attention_triton(q, k_new, v_new, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                           meta.suffix_mask, scale, max_context_len=meta.max_context_len,
                                           out_dtype=out_dtype, pdl=pdl)
    o_p, lse_p = prefix_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                  meta.max_context_len, meta.block_size, scale)
    o_s, lse_s = attend(q, k_new, v_new, meta.suffix_mask, scale)
    o, _ = merge_attention(o_p, lse_p, o_s, lse_s)
    return o
