"""Triton kernels for split tree attention (held to `eyas.layers.attention`, the plain-PyTorch reference).

* `paged_prefix_attention`: flash-decoding over the paged cache. Grid (batch x kv-head, query-row tile, KV split).
  A program takes every query row of one kv head (the Q new tokens x the G query heads sharing that kv head, so
  GQA loads each K/V tile once for all of them), walks its split of the context through the block table and keeps
  an online softmax; `_reduce_splits_kernel` merges the splits by log-sum-exp.
* `tree_suffix_attention`: the new tokens among themselves (plus any earlier tree tokens) under an explicit
  visibility mask. Grid (batch x kv-head, query-row tile).
* `merge_attention_states`: a standalone log-sum-exp merge of two partial results.
* `split_tree_attention_triton`: one grid whose programs walk the prefix's KV splits and, beside them, the suffix
  (`_split_tree_kernel`, the same two walks as the kernels above), then `_reduce_splits_kernel` merges the S + 1
  partial results. Two launches per layer, and the second is the short one plain decoding also ends with. (Until
  session 7 the suffix kernel ran after the prefix, seeded with its splits: 4.5 us of a 8.1 us layer on the H200
  for a 48-node tree at batch 1.)

Every function returns float32 o [B, Q, H, D] and lse [B, Q, H] (natural log). A row that sees no key gets o = 0 and
lse = -inf (the reference gives the same for each part; its final merge of two such parts gives NaN, ours 0).

Triton is imported here, not in `eyas.kernels.__init__`, so that importing the package costs nothing and
`TRITON_INTERPRET=1` can be set before Triton is first imported.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import gdc_prologue, interpreting, pdl_launch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

_DOT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Programmatic dependent launch for these kernels where the caller asks for it (`pdl=True`: the one-row and few-rows
# paths, whose linears are PDL launches): each program lets the next kernel's programs launch at once, then waits
# for the previous kernel before it reads anything. The kernel after the attention (its reduction, or the o
# projection, which loads its weights before its own wait) can then start while the attention runs. On since
# session 20 timed it on the H200 (plain decoding: SmolLM2 0.478 against 0.550 ms a token, the 8B shape 4.065
# against 4.146); `eyas.kernels.tree_attention.PDL = False` to compare.
PDL = True

# A graph fixes the prefix's split count by the widest context it may see (its max_context_len: the engine's graphs
# take it from their context bucket, `eyas.engine.cuda_graph.CONTEXT_BUCKETS`; without one, the block table's
# width), so a shorter context leaves splits without keys. Where the splits' partial o take more than
# SKIP_EMPTY_BYTES, such a split exits after loading its queries and stores nothing, neither o nor lse; the
# reduction computes from the context length which splits saw keys (`_splits_with_keys`) and reads only theirs. And
# the tree grid's suffix programs then take the first index of the split axis (dispatched before the prefix splits
# rather than after them: SUFFIX_FIRST). Below that line every split stores its o and lse and the reduction reads
# them all at once, as before session 33: there skipping loses (the figures below). Measured on the H200 at
# SmolLM2's shapes (docs/benchmarks.md, "Session 34"; tools/diag/empty_splits_bench.py, 30 layers in a graph, 59
# splits of a table 8256 tokens wide, session 34's call 8): the tree's verify attention 6.51 us a layer at 150 keys
# against 8.76 with every split stored (session 33's skip, splits that stored their lse and a reduction whose o
# loads waited for it: 8.33 in call 7), 7.94 against 9.96 at 1,500 keys, 14.60 against 14.46 at 7,000. Where it loses
# (call 1, the first form, which exited before its query load): with 8 splits (a 512-token bucket, 0.9 MB) 6.34
# against 5.61 us, and one-token decoding (0.15 MB) 3.77 against 3.41.
# SKIP_EMPTY_SPLITS = False turns it off everywhere (for comparing).
SKIP_EMPTY_SPLITS = True
SKIP_EMPTY_BYTES = 2 << 20
SUFFIX_FIRST = True

# The prefix's first keys before the PDL wait: not kept (session 43). The target's plain decoding and verify passes
# (whose committed K/V are all written before the step's first kernel) let each prefix split load the context length,
# its first tile's block-table entries and keys before its wait, then read the length again (the keys again where it
# changed) and plain decoding's new key. Correct (stale early copies in its tests), and slower on the real SmolLM2 on
# the H200 (MT-Bench 80 x 128, two processes each): plain decoding 0.426-0.427 ms a token against 0.413, the default
# tree's step 1.061-1.073 against 1.046-1.047 (`chain:3` 0.758-0.765 against 0.778); the 8B shape's plain step
# 4.184 against 4.151. Its registers (the 8B shape's prefix kernel 96 -> 184) and the extra work before the wait
# cost more than the shorter chain after it saves. The code is in git history (8cf6ec4).

# An L2 prefetch of the next kernel's weight: not kept (session 45). The prefix and tree grids' programs asked L2
# (`prefetch.global.L2`, their share of 128-byte lines each) for the o projection's weight of a wide model (>= 8 MiB:
# the 8B shape's 33.5 MB, which the H200's 60 MB L2 holds; the register kernel reads it from L2 in 6.0 us against 9.4
# from HBM, back to back), so that HBM would stream it while the attention runs. On the H200 (8B shape, batch 1,
# 16 x 128, processes alternated) it lost issued before the PDL wait (plain 4.225 / 4.227 ms a step against 4.137 /
# 4.130; `chain:3` 5.146 / 5.138 against 5.059 / 5.059) and after each program's store (4.229 / 4.213 against
# 4.143 / 4.146; 5.152 / 5.152 against 5.067 / 5.070), most likely because the 33.5 MB of requests delay the
# attention's own few loads more than the o projection gains (not profiled). The code is in git history (0cacb10).

# One pass for short contexts: not kept (session 35). Session 34 rebuilt session 17's one-launch attention for a
# 256-token context bucket (a tree program walked the whole prefix, then the suffix, merging the two in registers;
# one-token decoding took one split). In the engine on the H200 (smollm2-shape, batch 1, docs/benchmarks.md,
# "Session 35") it lost: plain decoding 0.490 / 0.545 ms a step against 0.459 / 0.460 at 64 / 128-token prompts,
# the default tree 1.192 / 1.261 against 1.166 / 1.179. Its grid was small: 3 programs (one per KV head) for a
# decode step and 30 for the 49-token tree, where the split kernels launch 24 and 81 in a 512-token bucket (8
# splits). The code is in git history (added in 0f18f8d, removed after d2e21f4).


def _split_bound(max_context_len, block_tables: torch.Tensor, page: int) -> int:
    """The context the split count is chosen for: `max_context_len` where the caller gives it, else the block
    table's width."""
    return int(max_context_len) if max_context_len is not None else block_tables.shape[1] * page


def _skip_empty(o_part: torch.Tensor) -> bool:
    """Whether the splits behind the partials `o_part` skip their empty o (and the reduction reads the seen)."""
    return SKIP_EMPTY_SPLITS and o_part.numel() * o_part.element_size() > SKIP_EMPTY_BYTES


def _gdc(pdl: bool) -> tuple[bool, dict]:
    """(USE_GDC for a kernel, its launch keywords): PDL where asked, switched on, and not under the interpreter."""
    return pdl_launch(pdl and PDL)


# ----------------------------------------------------------------------------------------------------------------------
# Shared device helpers


@triton.jit
def _load_q_rows(Q, K, b, kvh, rows, offs_d, n_rows, G: tl.constexpr, HEAD_D: tl.constexpr,
                 stride_qb, stride_qq, stride_qh, stride_qd, UPCAST: tl.constexpr):
    """The query tile of one kv head: row r is (token r // G, head kvh * G + r % G). Returns [BLOCK_M, BLOCK_D] in
    the keys' dtype (K: any key pointer), float32 with UPCAST."""
    qi = rows // G
    h = kvh * G + rows % G
    ptrs = Q + b * stride_qb + qi[:, None] * stride_qq + h[:, None] * stride_qh + offs_d[None, :] * stride_qd
    mask = (rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_D)
    q = tl.load(ptrs, mask=mask, other=0.0).to(K.dtype.element_ty)
    if UPCAST:  # the Triton interpreter's bf16 tl.dot is wrong: do its dots in float32 (exact products)
        q = q.to(tl.float32)
    return q


@triton.jit
def _program_rows(Q, K, n_rows, num_kv_heads, stride_qb, stride_qq, stride_qh, stride_qd, G: tl.constexpr,
                  HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """The prologue of every attention program: grid axis 0 is (sequence b, kv head), axis 1 the tile of query rows.
    Returns (b, kvh, rows, offs_d, d_ok, q), q the query tile (`_load_q_rows`)."""
    pid_bh = tl.program_id(0)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    q = _load_q_rows(Q, K, b, kvh, rows, offs_d, n_rows, G, HEAD_D, stride_qb, stride_qq, stride_qh, stride_qd,
                     UPCAST)
    return b, kvh, rows, offs_d, d_ok, q


@triton.jit
def _store_rows(O, LSE, b, kvh, rows, offs_d, n_rows, acc, m_i, l_i, G: tl.constexpr, HEAD_D: tl.constexpr,
                stride_ob, stride_oq, stride_oh, stride_od, stride_lb, stride_lq, stride_lh):
    """Normalise an online-softmax state (m_i in log2 units) and store the natural-log lse and o of the first n_rows
    rows; empty rows get o = 0 and lse = -inf."""
    qi = rows // G
    h = kvh * G + rows % G
    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    o = acc * inv[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    row_ok = rows < n_rows
    o_ptrs = O + b * stride_ob + qi[:, None] * stride_oq + h[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D))
    tl.store(LSE + b * stride_lb + qi * stride_lq + h * stride_lh, lse, mask=row_ok)


@triton.jit
def _score_tile(q, k, visible, qk_scale, m_i, l_i, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of an online softmax (log2 units): the scores q k^T of the keys `visible` marks ([BLOCK_M,
    BLOCK_N] or broadcastable) update the running max m_i and sum l_i. Returns (p, alpha, m_new, l_new); the caller's
    accumulator becomes acc * alpha + p v (`_accumulate_tile`). A row that has seen no key yet stays empty."""
    if UPCAST:  # the Triton interpreter's bf16 tl.dot is wrong: do its dots in float32 (exact products)
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _accumulate_tile(acc, alpha, p, v, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        v = v.to(tl.float32)
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)


@triton.jit
def _splits_with_keys(ctx, num_splits, BLOCK_N: tl.constexpr):
    """How many splits of `_walk_prefix`'s cut of a ctx-key context hold keys: splits 0 .. n-1 (ctx may be a
    tensor of contexts)."""
    tiles = tl.cdiv(ctx, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(tiles, num_splits), 1)
    return tl.cdiv(tiles, tiles_per_split)


@triton.jit
def _walk_prefix(q, k_head, v_head, bt_row, ctx, split, num_splits, offs_d, d_ok, qk_scale,
                 stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_btn,
                 PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax of the query tile over split `split` of the ctx cache entries of one sequence and kv head,
    walked through its block table (no mask). Returns the unnormalised state (m in log2 units, l, acc).
    The context is cut into num_splits equal chunks (whole BLOCK_N tiles), so that every split of a sequence does
    about the same work whatever the other sequences' lengths are."""
    tiles_per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_ok = pos < end
        blk = tl.load(bt_row + (pos // PAGE) * stride_btn, mask=n_ok, other=0).to(tl.int64)
        off = (pos % PAGE).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + blk[:, None] * stride_kb + off[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        p, alpha, m_i, l_i = _score_tile(q, k, n_ok[None, :], qk_scale, m_i, l_i, DOT_PREC, UPCAST)
        v = tl.load(v_head + blk[:, None] * stride_vb + off[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        acc = _accumulate_tile(acc, alpha, p, v, DOT_PREC, UPCAST)
    return m_i, l_i, acc


@triton.jit
def _walk_suffix(q, k_base, v_base, m_base, kv_len, row_ok, offs_d, d_ok, qk_scale,
                 stride_kl, stride_kd, stride_vl, stride_vd, stride_ml,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Online softmax of the query tile over the kv_len dense suffix keys of one sequence and kv head, each row
    seeing the keys its mask row (m_base, [BLOCK_M] pointers) marks nonzero. Returns the unnormalised state (m in
    log2 units, l, acc)."""
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, kv_len, BLOCK_N):
        pos = n0 + offs_n
        n_ok = pos < kv_len
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + pos[:, None] * stride_kl + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        vis = tl.load(m_base[:, None] + pos[None, :] * stride_ml, mask=row_ok[:, None] & n_ok[None, :], other=0)
        p, alpha, m_i, l_i = _score_tile(q, k, vis != 0, qk_scale, m_i, l_i, DOT_PREC, UPCAST)
        v = tl.load(v_base + pos[:, None] * stride_vl + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = _accumulate_tile(acc, alpha, p, v, DOT_PREC, UPCAST)
    return m_i, l_i, acc


# ----------------------------------------------------------------------------------------------------------------------
# Prefix: paged, unmasked, split over the context


@triton.jit
def _paged_prefix_kernel(
    Q, K, V, BT, CL, O, LSE,
    qk_scale,  # softmax scale * log2(e)
    n_rows,  # Q * G
    num_kv_heads,
    num_splits,
    stride_qb, stride_qq, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ob, stride_os, stride_oq, stride_oh, stride_od,
    stride_lb, stride_ls, stride_lq, stride_lh,
    G: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, USE_GDC: tl.constexpr = False, SKIP_EMPTY: tl.constexpr = False,
):
    """SKIP_EMPTY: a split without keys stores nothing (`_reduce_splits_kernel` with KEYED reads only the splits
    with keys); for the partials of a reduction only. It exits after its query load, which so stays off the critical
    path of the splits with keys (loaded before their context length is known, as without SKIP_EMPTY)."""
    gdc_prologue(USE_GDC)
    pid_s = tl.program_id(2)
    b, kvh, rows, offs_d, d_ok, q = _program_rows(Q, K, n_rows, num_kv_heads, stride_qb, stride_qq, stride_qh,
                                                  stride_qd, G, HEAD_D, BLOCK_M, BLOCK_D, UPCAST)
    ctx = tl.load(CL + b).to(tl.int32)
    if SKIP_EMPTY:
        if pid_s >= _splits_with_keys(ctx, num_splits, BLOCK_N):
            return  # no key: nothing stored; the reduction knows
    m_i, l_i, acc = _walk_prefix(q, K + kvh * stride_kh, V + kvh * stride_vh, BT + b * stride_btb,
                                 ctx, pid_s, num_splits, offs_d, d_ok, qk_scale,
                                 stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_btn,
                                 PAGE, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC, UPCAST)
    _store_rows(O + pid_s * stride_os, LSE + pid_s * stride_ls, b, kvh, rows, offs_d, n_rows, acc, m_i, l_i,
                G, HEAD_D, stride_ob, stride_oq, stride_oh, stride_od, stride_lb, stride_lq, stride_lh)


@triton.jit
def _reduce_splits_kernel(
    O_part, LSE_part, O, LSE,
    num_q, num_heads, num_splits,
    stride_pb, stride_ps, stride_pq, stride_ph, stride_pd,
    stride_plb, stride_pls, stride_plq, stride_plh,
    stride_ob, stride_oq, stride_oh, stride_od,
    stride_lb, stride_lq, stride_lh,
    BLOCK_S: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr = False,
    KEYED: tl.constexpr = False, CL=None, num_prefix=0, BLOCK_N: tl.constexpr = 1,
):
    """One program per (b, q, h) row: o = sum_s o_s exp(lse_s - lse), lse = logsumexp_s lse_s. The o of a partial
    whose lse is -inf (it saw no key) gets no weight. KEYED (SKIP_EMPTY's splits, which store nothing without keys):
    partial s is read only where it is a prefix split with keys (`_splits_with_keys` of the context CL[b],
    num_prefix splits of BLOCK_N-key tiles) or past the prefix's splits (the suffix's)."""
    gdc_prologue(USE_GDC)
    pid = tl.program_id(0)
    h = pid % num_heads
    qi = (pid // num_heads) % num_q
    b = pid // (num_heads * num_q)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    if KEYED:
        ctx = tl.load(CL + b).to(tl.int32)
        s_ok = s_ok & ((offs_s < _splits_with_keys(ctx, num_prefix, BLOCK_N)) | (offs_s >= num_prefix))
    lse_s = tl.load(LSE_part + b * stride_plb + offs_s * stride_pls + qi * stride_plq + h * stride_plh,
                    mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)  # 0 for empty splits
    total = tl.sum(w, axis=0)
    o_s = tl.load(O_part + b * stride_pb + offs_s[:, None] * stride_ps + qi * stride_pq + h * stride_ph
                  + offs_d[None, :] * stride_pd, mask=s_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    has = total > 0.0
    denom = tl.where(has, total, 1.0)
    o = tl.sum(o_s * w[:, None], axis=0) / denom
    lse = tl.where(has, m_safe + tl.log(denom), float("-inf"))
    tl.store(O + b * stride_ob + qi * stride_oq + h * stride_oh + offs_d * stride_od, o.to(O.dtype.element_ty),
             mask=offs_d < HEAD_D)
    tl.store(LSE + b * stride_lb + qi * stride_lq + h * stride_lh, lse)


# ----------------------------------------------------------------------------------------------------------------------
# Suffix: the step's own tokens under a mask


@triton.jit
def _tree_suffix_kernel(
    Q, K, V, MASK, O, LSE,
    qk_scale,
    n_rows,  # Q * G
    kv_len,  # L: keys of the suffix (earlier tree tokens + the new ones)
    num_kv_heads,
    stride_qb, stride_qq, stride_qh, stride_qd,
    stride_kb, stride_kl, stride_kh, stride_kd,
    stride_vb, stride_vl, stride_vh, stride_vd,
    stride_mb, stride_mq, stride_ml,
    stride_ob, stride_oq, stride_oh, stride_od,
    stride_lb, stride_lq, stride_lh,
    G: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    b, kvh, rows, offs_d, d_ok, q = _program_rows(Q, K, n_rows, num_kv_heads, stride_qb, stride_qq, stride_qh,
                                                  stride_qd, G, HEAD_D, BLOCK_M, BLOCK_D, UPCAST)
    row_ok = rows < n_rows
    qi = rows // G
    m_i, l_i, acc = _walk_suffix(q, K + b * stride_kb + kvh * stride_kh, V + b * stride_vb + kvh * stride_vh,
                                 MASK + b * stride_mb + qi * stride_mq, kv_len, row_ok, offs_d, d_ok, qk_scale,
                                 stride_kl, stride_kd, stride_vl, stride_vd, stride_ml,
                                 BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC, UPCAST)
    _store_rows(O, LSE, b, kvh, rows, offs_d, n_rows, acc, m_i, l_i, G, HEAD_D,
                stride_ob, stride_oq, stride_oh, stride_od, stride_lb, stride_lq, stride_lh)


# ----------------------------------------------------------------------------------------------------------------------
# Prefix splits and suffix in one grid (the partials that `_reduce_splits_kernel` merges)


@triton.jit
def _split_tree_kernel(
    Q, KC, VC, BT, CL, KN, VN, MASK, O, LSE,
    qk_scale,
    n_rows,  # Q * G
    kv_len,  # L: suffix keys
    num_kv_heads,
    num_splits,  # S: prefix splits; program S of the split axis takes the suffix
    stride_qb, stride_qq, stride_qh, stride_qd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_btb, stride_btn,
    stride_knb, stride_knl, stride_knh, stride_knd,
    stride_vnb, stride_vnl, stride_vnh, stride_vnd,
    stride_mb, stride_mq, stride_ml,
    stride_ob, stride_os, stride_oq, stride_oh, stride_od,
    stride_lb, stride_ls, stride_lq, stride_lh,
    G: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NS: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, USE_GDC: tl.constexpr = False, SKIP_EMPTY: tl.constexpr = False,
    SUFFIX_FIRST: tl.constexpr = False,
):
    """SKIP_EMPTY: as `_paged_prefix_kernel`'s (the suffix's program always stores its partial). SUFFIX_FIRST: grid
    index 0 of the split axis takes the suffix and index s + 1 split s (the partials keep their places: the
    suffix's is S)."""
    gdc_prologue(USE_GDC)
    pid_s = tl.program_id(2)
    if SUFFIX_FIRST:
        pid_s = tl.where(pid_s == 0, num_splits, pid_s - 1)
    b, kvh, rows, offs_d, d_ok, q = _program_rows(Q, KC, n_rows, num_kv_heads, stride_qb, stride_qq, stride_qh,
                                                  stride_qd, G, HEAD_D, BLOCK_M, BLOCK_D, UPCAST)
    ctx = tl.load(CL + b).to(tl.int32)
    if SKIP_EMPTY:
        if pid_s < num_splits and pid_s >= _splits_with_keys(ctx, num_splits, BLOCK_N):
            return  # no key: nothing stored; the reduction knows
    row_ok = rows < n_rows
    qi = rows // G

    if pid_s < num_splits:  # a split of the prefix, as `_paged_prefix_kernel` walks it
        m_i, l_i, acc = _walk_prefix(q, KC + kvh * stride_kch, VC + kvh * stride_vch, BT + b * stride_btb,
                                     ctx, pid_s, num_splits, offs_d, d_ok, qk_scale,
                                     stride_kcb, stride_kcs, stride_kcd, stride_vcb, stride_vcs, stride_vcd,
                                     stride_btn, PAGE, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC, UPCAST)
    else:  # the suffix keys under the mask
        m_i, l_i, acc = _walk_suffix(q, KN + b * stride_knb + kvh * stride_knh, VN + b * stride_vnb + kvh * stride_vnh,
                                     MASK + b * stride_mb + qi * stride_mq, kv_len, row_ok, offs_d, d_ok, qk_scale,
                                     stride_knl, stride_knd, stride_vnl, stride_vnd, stride_ml,
                                     BLOCK_M, BLOCK_NS, BLOCK_D, DOT_PREC, UPCAST)
    _store_rows(O + pid_s * stride_os, LSE + pid_s * stride_ls, b, kvh, rows, offs_d, n_rows, acc, m_i, l_i,
                G, HEAD_D, stride_ob, stride_oq, stride_oh, stride_od, stride_lb, stride_lq, stride_lh)


# ----------------------------------------------------------------------------------------------------------------------
# Standalone merge


@triton.jit
def _merge_kernel(
    O1, L1, O2, L2, O, L,
    n_rows,
    stride_o1r, stride_o1d, stride_o2r, stride_o2d, stride_or, stride_od,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < n_rows
    mask = r_ok[:, None] & (offs_d[None, :] < HEAD_D)
    rows64 = rows.to(tl.int64)
    l1 = tl.load(L1 + rows64, mask=r_ok, other=float("-inf")).to(tl.float32)
    l2 = tl.load(L2 + rows64, mask=r_ok, other=float("-inf")).to(tl.float32)
    m = tl.maximum(l1, l2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.exp(l1 - m_safe)
    w2 = tl.exp(l2 - m_safe)
    total = w1 + w2
    has = total > 0.0
    denom = tl.where(has, total, 1.0)
    o1 = tl.load(O1 + rows64[:, None] * stride_o1r + offs_d[None, :] * stride_o1d, mask=mask, other=0.0)
    o2 = tl.load(O2 + rows64[:, None] * stride_o2r + offs_d[None, :] * stride_o2d, mask=mask, other=0.0)
    o = (o1.to(tl.float32) * (w1 / denom)[:, None] + o2.to(tl.float32) * (w2 / denom)[:, None])
    tl.store(O + rows64[:, None] * stride_or + offs_d[None, :] * stride_od, o.to(O.dtype.element_ty), mask=mask)
    tl.store(L + rows64, tl.where(has, m_safe + tl.log(denom), float("-inf")), mask=r_ok)


# ----------------------------------------------------------------------------------------------------------------------
# Host side


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _tiles(n_rows: int, head_dim: int, dtype: torch.dtype, kv_len: int | None = None):
    """(BLOCK_M, BLOCK_N, BLOCK_D). BLOCK_M holds all Q*G rows of a kv head up to 64 (padded to at least 16 for
    tl.dot); BLOCK_N is 64 keys, 32 when the [M, D] accumulator is large. fp32 inputs take exact (FMA) dots, which
    need smaller tiles (ptxas for sm_90: 16-bit tiles do not spill; fp32 prefix tiles at D >= 96 spill a little)."""
    block_d = max(16, _next_pow2(head_dim))  # any head_dim: loads are masked to it
    cap_m = 64 if dtype != torch.float32 else 32
    block_m = min(cap_m, max(16, _next_pow2(n_rows)))
    if dtype == torch.float32:
        block_n = 16 if block_m * block_d >= 32 * 128 else 32
    else:
        block_n = 32 if block_m * block_d >= 64 * 128 else 64
    if kv_len is not None:
        block_n = min(block_n, max(16, _next_pow2(kv_len)))
    return block_m, block_n, block_d


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches get exact fp32 products (no TF32) so that they match the reference; 16-bit types ignore this.
    return "ieee" if dtype == torch.float32 or interpreting() else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    """Under TRITON_INTERPRET the interpreter computes bf16 tl.dot wrongly (numpy has no bf16); upcast there."""
    return dtype == torch.bfloat16 and interpreting()


def _check_dtype(t: torch.Tensor, name: str):
    if t.dtype not in _DOT_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} not supported (float32, float16 or bfloat16)")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device | None = None) -> int:
    """Streaming multiprocessors of `device` (132 for an H100/H200 SXM when there is no CUDA device)."""
    if device is not None and torch.device(device).type == "cuda":
        idx = torch.device(device).index
        return _num_sms(torch.cuda.current_device() if idx is None else idx)
    return 132


def choose_num_splits(num_programs: int, max_context_len: int, num_sms: int = 132, waves: int = 4,
                      min_tokens_per_split: int = 64, max_splits: int = 64) -> int:
    """KV splits for the prefix kernel (flash-decoding).

    `num_programs` is the grid without splits (batch x kv-heads x query-row tiles). A grid that already has a
    program per SM gets 1 split (no reduction pass). Below that, splits are added until about `waves` programs
    per SM exist, but no split gets fewer than `min_tokens_per_split` context tokens (one key tile).

    Tuned on the H200 at the Llama-3.1-8B shape (32 query / 8 kv heads, D = 128, bf16; `tools/diag/
    prefix_split_bench.py`, 2026-11-29, docs/benchmarks.md): at batch 1 and a 1k context 16 splits took 7.8 us per
    layer against 12.4 us with the earlier rule (waves 2, >= 256 tokens: 4 splits); at batch 8 and 4k, 8 splits
    took 39.8 us against 45.5 us (this rule gives 16-18 and 9 there; those counts were not timed); at batch 32
    more splits than 1 only add the reduction (43 us at 3 splits against 39.6 us at 1)."""
    if num_programs <= 0 or max_context_len <= 0:
        return 1
    if num_programs >= num_sms:
        return 1
    want = math.ceil(waves * num_sms / num_programs)
    by_len = max(1, int(max_context_len) // min_tokens_per_split)
    return int(max(1, min(want, by_len, max_splits)))


def _prefix_block_n(block_m: int, block_n: int, block_d: int, splits: int, dtype: torch.dtype,
                    max_context_len: int) -> int:
    """Key-tile width of the prefix kernel: 128 keys when one program walks a whole long context (1 split, 16-bit,
    a [16, <=128] query tile), which halves the serial steps (batch 32, 1k context, 8B shape: 39.6 us per layer
    against 48.9 us with 64 keys); the `_tiles` width otherwise."""
    if splits == 1 and dtype != torch.float32 and block_m * block_d <= 16 * 128 and max_context_len >= 512:
        return 128
    return block_n


def _partials(shape, dtype, device) -> torch.Tensor:
    """A buffer of the splits' partial o (or lse), left unwritten where a split saw no key (SKIP_EMPTY); the tests
    fill it with NaN to show that nothing reads those rows."""
    return torch.empty(shape, dtype=dtype, device=device)


def paged_prefix_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None,
                           max_context_len=None, block_n=None, reduce=True, out_dtype=torch.float32, pdl=False):
    """Attention of every new token over its sequence's first `context_lens[b]` cache entries, without mask.

    q [B, Q, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks] (int32/int64);
    context_lens [B]. `max_context_len` (a host int, optional) only steers the split heuristic; without it the
    block-table width is used, so that no device value is read back (CUDA-graph safe).
    Returns o [B, Q, H, D] float32 and lse [B, Q, H] float32; rows with context 0 get o = 0, lse = -inf.
    `reduce=False`: the KV splits' partial results instead, o [B, S, Q, H, D] and lse [B, S, Q, H], for a kernel
    that merges them itself (`tree_suffix_attention`), one kernel launch fewer. `out_dtype`: the reduced o's dtype
    (the model's, so that no cast follows; the partials and lse stay float32). `pdl`: launch with programmatic
    dependent launch (where `PDL` is on)."""
    B, NQ, H, D = q.shape
    _, page, KVH, Dk = k_cache.shape
    if Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if H % KVH:
        raise ValueError(f"{H} query heads are not a multiple of {KVH} kv heads")
    if page & (page - 1):
        raise ValueError(f"block_size must be a power of two, got {page}")
    for t, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        _check_dtype(t, n)
    G = H // KVH
    n_rows = NQ * G
    BLOCK_M, BLOCK_N, BLOCK_D = _tiles(n_rows, D, k_cache.dtype)
    if block_n is not None:
        BLOCK_N = max(16, _next_pow2(block_n))
    m_tiles = triton.cdiv(n_rows, BLOCK_M)
    bound = _split_bound(max_context_len, block_tables, page)
    if num_splits is None:
        num_splits = choose_num_splits(B * KVH * m_tiles, int(bound), device_sm_count(q.device))
    S = max(1, int(num_splits))
    if block_n is None:
        BLOCK_N = _prefix_block_n(BLOCK_M, BLOCK_N, BLOCK_D, S, k_cache.dtype, int(bound))

    if B == 0 or NQ == 0:
        o, lse = (torch.zeros((B, NQ, H, D), dtype=torch.float32, device=q.device),
                  torch.full((B, NQ, H), float("-inf"), dtype=torch.float32, device=q.device))
        return (o, lse) if reduce else (o.unsqueeze(1), lse.unsqueeze(1))
    # one split reduced is the split itself: written in the output dtype at once
    o_part = _partials((B, S, NQ, H, D), out_dtype if (reduce and S == 1) else torch.float32, q.device)
    lse_part = _partials((B, S, NQ, H), torch.float32, q.device)
    use_gdc, launch = _gdc(pdl)
    skip = reduce and S > 1 and _skip_empty(o_part)
    _paged_prefix_kernel[(B * KVH, m_tiles, S)](
        q, k_cache, v_cache, block_tables, context_lens, o_part, lse_part,
        float(scale) * LOG2E, n_rows, KVH, S,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *o_part.stride(), *lse_part.stride(),
        G=G, HEAD_D=D, BLOCK_D=BLOCK_D, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        DOT_PREC=_dot_precision(k_cache.dtype), UPCAST=_upcast(k_cache.dtype), USE_GDC=use_gdc,
        SKIP_EMPTY=skip, num_warps=4, num_stages=2, **launch,
    )
    if not reduce:
        return o_part, lse_part
    if S == 1:
        return o_part[:, 0], lse_part[:, 0]
    return _reduce_splits(o_part, lse_part, out_dtype, pdl, keyed=(context_lens, S, BLOCK_N) if skip else None)


def _reduce_splits(o_part, lse_part, out_dtype, pdl=False, keyed=None):
    """Merge partial results o_part [B, S, Q, H, D], lse_part [B, S, Q, H] (float32) by log-sum-exp: one launch.
    Returns o [B, Q, H, D] in `out_dtype` and lse [B, Q, H] float32. `keyed` (context_lens, prefix splits, key
    tile): the splits without keys stored nothing (SKIP_EMPTY), so only those with keys and any partial past the
    prefix's are read."""
    B, S, NQ, H, D = o_part.shape
    o = torch.empty((B, NQ, H, D), dtype=out_dtype, device=o_part.device)
    lse = torch.empty((B, NQ, H), dtype=torch.float32, device=o_part.device)
    use_gdc, launch = _gdc(pdl)
    cl, num_prefix, block_n = keyed if keyed is not None else (None, 0, 1)
    _reduce_splits_kernel[(B * NQ * H,)](
        o_part, lse_part, o, lse, NQ, H, S,
        *o_part.stride(), *lse_part.stride(), *o.stride(), *lse.stride(),
        BLOCK_S=max(2, _next_pow2(S)), HEAD_D=D, BLOCK_D=_next_pow2(D), USE_GDC=use_gdc,
        KEYED=keyed is not None, CL=cl, num_prefix=num_prefix, BLOCK_N=block_n, num_warps=1, **launch,
    )
    return o, lse


def tree_suffix_attention(q, k_new, v_new, suffix_mask, scale, out_dtype=torch.float32):
    """Attention of the Q new tokens over the suffix keys under `suffix_mask`.

    q [B, Q, H, D]; k_new/v_new [B, L, KVH, D] (L = Q, or P + Q with earlier tree tokens first);
    suffix_mask [B, Q, L] bool (or integer, nonzero = visible).
    Returns o [B, Q, H, D] (`out_dtype`, float32 by default) and lse [B, Q, H] float32."""
    B, NQ, H, D = q.shape
    _, L, KVH, Dk = k_new.shape
    if Dk != D or v_new.shape != k_new.shape or k_new.shape[0] != B:
        raise ValueError(f"k/v shapes {tuple(k_new.shape)}/{tuple(v_new.shape)} do not fit q {tuple(q.shape)}")
    if H % KVH:
        raise ValueError(f"{H} query heads are not a multiple of {KVH} kv heads")
    if tuple(suffix_mask.shape) != (B, NQ, L):
        raise ValueError(f"suffix_mask shape {tuple(suffix_mask.shape)}, expected {(B, NQ, L)}")
    for t, n in ((q, "q"), (k_new, "k_new"), (v_new, "v_new")):
        _check_dtype(t, n)
    if suffix_mask.dtype == torch.bool:
        suffix_mask = suffix_mask.view(torch.uint8)  # same bytes; Triton loads it as an integer
    G = H // KVH
    n_rows = NQ * G
    BLOCK_M, BLOCK_N, BLOCK_D = _tiles(n_rows, D, k_new.dtype, kv_len=L)
    m_tiles = triton.cdiv(n_rows, BLOCK_M)
    o = torch.empty((B, NQ, H, D), dtype=out_dtype, device=q.device)
    lse = torch.empty((B, NQ, H), dtype=torch.float32, device=q.device)
    if B == 0 or NQ == 0:
        return o, lse
    _tree_suffix_kernel[(B * KVH, m_tiles)](
        q, k_new, v_new, suffix_mask, o, lse,
        float(scale) * LOG2E, n_rows, L, KVH,
        *q.stride(), *k_new.stride(), *v_new.stride(), *suffix_mask.stride(),
        *o.stride(), *lse.stride(),
        G=G, HEAD_D=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        DOT_PREC=_dot_precision(k_new.dtype), UPCAST=_upcast(k_new.dtype), num_warps=4, num_stages=2,
    )
    return o, lse


def merge_attention_states(o1, lse1, o2, lse2):
    """Exact merge of two attention results over disjoint key sets: o [..., D] float32, lse [...] float32.
    Rows empty in both (lse -inf twice) get o = 0, lse = -inf."""
    if o1.shape != o2.shape or lse1.shape != lse2.shape or o1.shape[:-1] != lse1.shape:
        raise ValueError("o1/o2 must share [..., D] and lse1/lse2 its [...] shape")
    D = o1.shape[-1]
    o1r, o2r = o1.reshape(-1, D), o2.reshape(-1, D)
    l1, l2 = lse1.reshape(-1).contiguous(), lse2.reshape(-1).contiguous()
    n = l1.numel()
    o = torch.empty((n, D), dtype=torch.float32, device=o1.device)
    lse = torch.empty((n,), dtype=torch.float32, device=o1.device)
    if n:
        BLOCK_R = 16
        _merge_kernel[(triton.cdiv(n, BLOCK_R),)](
            o1r, l1, o2r, l2, o, lse, n, *o1r.stride(), *o2r.stride(), *o.stride(),
            HEAD_D=D, BLOCK_D=_next_pow2(D), BLOCK_R=BLOCK_R, num_warps=4,
        )
    return o.view(o1.shape), lse.view(lse1.shape)


def split_tree_attention_triton(q, k_new, v_new, k_cache, v_cache, block_tables, context_lens, suffix_mask, scale,
                                num_splits=None, max_context_len=None, out_dtype=torch.float32, pdl=False):
    """Prefix (paged, no mask) + suffix (under `suffix_mask`), merged by log-sum-exp: o [B, Q, H, D] (`out_dtype`).

    Same contract as `eyas.layers.attention.split_tree_attention`: k_new/v_new [B, L, KVH, D] are the suffix keys
    (earlier tree tokens first, then the Q new ones; suffix_mask [B, Q, L]). Two launches: one grid whose programs
    walk the prefix's KV splits and, one more per query tile, the suffix (`_split_tree_kernel`), then the reduction
    of those S + 1 partial results. The suffix runs beside the prefix splits rather than after them, and the
    reduction is the cheap kernel plain decoding also ends with. A row that sees nothing at all gets 0 (the
    reference gives NaN). `pdl`: both launches with programmatic dependent launch (where `PDL` is on)."""
    B, NQ, H, D = q.shape
    _, page, KVH, Dk = k_cache.shape
    L = k_new.shape[1]
    if Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if k_new.dim() != 4 or tuple(k_new.shape[2:]) != (KVH, D) or v_new.shape != k_new.shape or k_new.shape[0] != B:
        raise ValueError(f"k/v shapes {tuple(k_new.shape)}/{tuple(v_new.shape)} do not fit q {tuple(q.shape)}")
    if H % KVH:
        raise ValueError(f"{H} query heads are not a multiple of {KVH} kv heads")
    if page & (page - 1):
        raise ValueError(f"block_size must be a power of two, got {page}")
    if tuple(suffix_mask.shape) != (B, NQ, L):
        raise ValueError(f"suffix_mask shape {tuple(suffix_mask.shape)}, expected {(B, NQ, L)}")
    for t, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (k_new, "k_new"), (v_new, "v_new")):
        _check_dtype(t, n)
    if k_new.dtype != k_cache.dtype:
        raise TypeError(f"suffix keys ({k_new.dtype}) and cache ({k_cache.dtype}) differ in dtype")
    if suffix_mask.dtype == torch.bool:
        suffix_mask = suffix_mask.view(torch.uint8)  # same bytes; Triton loads it as an integer
    G = H // KVH
    n_rows = NQ * G
    bound = _split_bound(max_context_len, block_tables, page)
    BLOCK_M, BLOCK_N, BLOCK_D = _tiles(n_rows, D, k_cache.dtype)
    BLOCK_NS = _tiles(n_rows, D, k_cache.dtype, kv_len=L)[1]
    m_tiles = triton.cdiv(n_rows, BLOCK_M)
    if num_splits is None:
        num_splits = choose_num_splits(B * KVH * m_tiles, int(bound), device_sm_count(q.device))
    S = max(1, int(num_splits))
    BLOCK_N = _prefix_block_n(BLOCK_M, BLOCK_N, BLOCK_D, S, k_cache.dtype, int(bound))
    if B == 0 or NQ == 0:
        return torch.zeros((B, NQ, H, D), dtype=out_dtype, device=q.device)
    o_part = _partials((B, S + 1, NQ, H, D), torch.float32, q.device)
    lse_part = _partials((B, S + 1, NQ, H), torch.float32, q.device)
    use_gdc, launch = _gdc(pdl)
    skip = _skip_empty(o_part)
    _split_tree_kernel[(B * KVH, m_tiles, S + 1)](
        q, k_cache, v_cache, block_tables, context_lens, k_new, v_new, suffix_mask, o_part, lse_part,
        float(scale) * LOG2E, n_rows, L, KVH, S,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *k_new.stride(), *v_new.stride(), *suffix_mask.stride(), *o_part.stride(), *lse_part.stride(),
        G=G, HEAD_D=D, BLOCK_D=BLOCK_D, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_NS=BLOCK_NS,
        DOT_PREC=_dot_precision(k_cache.dtype), UPCAST=_upcast(k_cache.dtype), USE_GDC=use_gdc,
        SKIP_EMPTY=skip, SUFFIX_FIRST=skip and SUFFIX_FIRST, num_warps=4, num_stages=2, **launch,
    )
    return _reduce_splits(o_part, lse_part, out_dtype, pdl, keyed=(context_lens, S, BLOCK_N) if skip else None)[0]
