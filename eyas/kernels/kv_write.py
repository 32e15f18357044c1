"""Triton kernels that store K/V rows into the paged cache.

* `write_kv_triton`: new K/V [B, Q, KVH, D] to flat cache slots [B, Q] (slot < 0 skipped); the reference is
  `eyas.layers.attention.write_kv`.
* `commit_tree_kv_triton`: after verification, copy the stashed K/V of the accepted tree nodes to the cache:
  stash [B, N+1, KVH, D], path [B, P] node indices (-1 = none), slots [B, P] flat slots (-1 = skip); the reference
  is `commit_tree_kv_reference` below. With a layer axis in front (stash [L, B, N+1, KVH, D], cache [L, blocks,
  block_size, KVH, D]) one launch commits every layer.

A flat slot s is block s // block_size, offset s % block_size of a cache [num_blocks, block_size, KVH, D]. Both
kernels run one program per (sequence, token) (and layer) and copy its KVH x D rows for K and V, casting to the
cache dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_row(SRC, DST, src_off, dst_block, dst_off, ok_h, offs_h, offs_d,
              stride_sh, stride_sd, stride_db, stride_ds, stride_dh, stride_dd,
              KVH: tl.constexpr, HEAD_D: tl.constexpr):
    # ok_h: [BLOCK_H] (a per-row copy of the row's validity: the interpreter cannot mix scalar and tensor masks)
    mask = (ok_h & (offs_h < KVH))[:, None] & (offs_d[None, :] < HEAD_D)
    x = tl.load(SRC + src_off + offs_h[:, None] * stride_sh + offs_d[None, :] * stride_sd, mask=mask, other=0.0)
    tl.store(DST + dst_block * stride_db + dst_off * stride_ds + offs_h[:, None] * stride_dh
             + offs_d[None, :] * stride_dd, x.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    KC, VC, K, V, SLOTS,
    num_q,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_kb, stride_kq, stride_kh, stride_kd,
    stride_vb, stride_vq, stride_vh, stride_vd,
    stride_sb, stride_sq,
    KVH: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // num_q
    qi = pid % num_q
    slot = tl.load(SLOTS + b * stride_sb + qi * stride_sq).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_h.to(tl.int64) * 0 + slot) >= 0  # [BLOCK_H], all equal
    slot = tl.maximum(slot, 0)
    blk = slot // PAGE
    off = slot % PAGE
    b64 = b.to(tl.int64)
    _copy_row(K, KC, b64 * stride_kb + qi * stride_kq, blk, off, ok, offs_h, offs_d,
              stride_kh, stride_kd, stride_kcb, stride_kcs, stride_kch, stride_kcd, KVH, HEAD_D)
    _copy_row(V, VC, b64 * stride_vb + qi * stride_vq, blk, off, ok, offs_h, offs_d,
              stride_vh, stride_vd, stride_vcb, stride_vcs, stride_vch, stride_vcd, KVH, HEAD_D)


@triton.jit
def _commit_tree_kv_kernel(
    KC, VC, SK, SV, PATH, SLOTS,
    path_len,
    num_nodes,
    stride_kcl, stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcl, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_skl, stride_skb, stride_skn, stride_skh, stride_skd,
    stride_svl, stride_svb, stride_svn, stride_svh, stride_svd,
    stride_pb, stride_pj,
    stride_sb, stride_sj,
    KVH: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    KC += layer * stride_kcl
    VC += layer * stride_vcl
    SK += layer * stride_skl
    SV += layer * stride_svl
    b = pid // path_len
    j = pid % path_len
    node = tl.load(PATH + b * stride_pb + j * stride_pj).to(tl.int64)
    slot = tl.load(SLOTS + b * stride_sb + j * stride_sj).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    node_h = offs_h.to(tl.int64) * 0 + node  # [BLOCK_H], all equal
    slot_h = offs_h.to(tl.int64) * 0 + slot
    ok = (node_h >= 0) & (node_h < num_nodes) & (slot_h >= 0)
    node = tl.minimum(tl.maximum(node, 0), num_nodes - 1)
    slot = tl.maximum(slot, 0)
    blk = slot // PAGE
    off = slot % PAGE
    b64 = b.to(tl.int64)
    _copy_row(SK, KC, b64 * stride_skb + node * stride_skn, blk, off, ok, offs_h, offs_d,
              stride_skh, stride_skd, stride_kcb, stride_kcs, stride_kch, stride_kcd, KVH, HEAD_D)
    _copy_row(SV, VC, b64 * stride_svb + node * stride_svn, blk, off, ok, offs_h, offs_d,
              stride_svh, stride_svd, stride_vcb, stride_vcs, stride_vch, stride_vcd, KVH, HEAD_D)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _check_cache(k_cache, v_cache):
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must both be [num_blocks, block_size, KVH, D], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    page = k_cache.shape[1]
    if page & (page - 1):
        raise ValueError(f"block_size must be a power of two, got {page}")
    return page, k_cache.shape[2], k_cache.shape[3]


def write_kv_triton(k_cache, v_cache, k, v, slot_mapping):
    """Store new K/V [B, Q, KVH, D] at flat cache slots `slot_mapping` [B, Q]; slots < 0 are skipped."""
    page, KVH, D = _check_cache(k_cache, v_cache)
    if k.shape != v.shape or k.dim() != 4 or tuple(k.shape[2:]) != (KVH, D):
        raise ValueError(f"k/v {tuple(k.shape)}/{tuple(v.shape)} do not fit the cache {tuple(k_cache.shape)}")
    B, NQ = k.shape[:2]
    if tuple(slot_mapping.shape) != (B, NQ):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)}, expected {(B, NQ)}")
    if B * NQ == 0:
        return
    _write_kv_kernel[(B * NQ,)](
        k_cache, v_cache, k, v, slot_mapping, NQ,
        *k_cache.stride(), *v_cache.stride(), *k.stride(), *v.stride(), *slot_mapping.stride(),
        KVH=KVH, HEAD_D=D, BLOCK_H=_next_pow2(KVH), BLOCK_D=_next_pow2(D), PAGE=page, num_warps=4,
    )


def commit_tree_kv_triton(k_cache, v_cache, stash_k, stash_v, path, slots):
    """Copy stashed K/V of accepted tree nodes into the cache.

    stash_k/stash_v [B, N+1, KVH, D]; path [B, P] node indices (-1 = none); slots [B, P] flat cache slots
    (-1 = skip). Entry j of sequence b copies stash[b, path[b, j]] to slot slots[b, j] when both are >= 0.
    All layers in one launch: caches [L, blocks, block_size, KVH, D] and stashes [L, B, N+1, KVH, D]."""
    layered = k_cache.dim() == 5
    if layered:
        if stash_k.dim() != 5 or stash_k.shape[0] != k_cache.shape[0] or v_cache.shape != k_cache.shape:
            raise ValueError(f"layered caches {tuple(k_cache.shape)} need stashes [L, B, N+1, KVH, D] of as many "
                             f"layers, got {tuple(stash_k.shape)}")
        L = k_cache.shape[0]
    else:
        k_cache, v_cache, stash_k, stash_v = (t.unsqueeze(0) for t in (k_cache, v_cache, stash_k, stash_v))
        L = 1
    page, KVH, D = _check_cache(k_cache[0], v_cache[0])
    if stash_k.shape != stash_v.shape or stash_k.dim() != 5 or tuple(stash_k.shape[3:]) != (KVH, D):
        raise ValueError(f"stash {tuple(stash_k.shape)}/{tuple(stash_v.shape)} does not fit the cache "
                         f"{tuple(k_cache.shape)}")
    B, N1 = stash_k.shape[1:3]
    if path.shape != slots.shape or path.dim() != 2 or path.shape[0] != B:
        raise ValueError(f"path {tuple(path.shape)} and slots {tuple(slots.shape)} must both be [B={B}, P]")
    P = path.shape[1]
    if B * P == 0:
        return
    _commit_tree_kv_kernel[(B * P, L)](
        k_cache, v_cache, stash_k, stash_v, path, slots, P, N1,
        *k_cache.stride(), *v_cache.stride(), *stash_k.stride(), *stash_v.stride(), *path.stride(),
        *slots.stride(),
        KVH=KVH, HEAD_D=D, BLOCK_H=_next_pow2(KVH), BLOCK_D=_next_pow2(D), PAGE=page, num_warps=4,
    )


def commit_tree_kv_reference(k_cache, v_cache, stash_k, stash_v, path, slots):
    """Plain-PyTorch reference of `commit_tree_kv_triton` (same arguments, same effect), a layer at a time."""
    if k_cache.dim() == 5:
        for layer in range(k_cache.shape[0]):
            commit_tree_kv_reference(k_cache[layer], v_cache[layer], stash_k[layer], stash_v[layer], path, slots)
        return
    B, N1 = stash_k.shape[:2]
    keep = (path >= 0) & (path < N1) & (slots >= 0)  # [B, P]
    b_idx = torch.arange(B, device=path.device)[:, None].expand_as(path)[keep]
    nodes = path[keep].long()
    dst = slots[keep].long()
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc[dst] = stash_k[b_idx, nodes].to(k_cache.dtype)
    vc[dst] = stash_v[b_idx, nodes].to(v_cache.dtype)
