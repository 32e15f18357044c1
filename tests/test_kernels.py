"""Triton kernels of eyas.kernels against the plain-PyTorch reference (eyas.layers.attention) and a dense SDPA oracle.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1 is set here, before Triton is first
imported: the interpreter is chosen when a kernel is decorated). With CUDA and TRITON_INTERPRET unset, the same
tests run the compiled kernels on the GPU, and the `gpu` tests (bf16 on many random shapes, CUDA graphs) run too.

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/test_kernels.py   # CPU, interpreter
    .venv/bin/python -m pytest -q tests/test_kernels.py                      # on a GPU machine: compiled
"""
import os

import torch

if not torch.cuda.is_available():  # `import torch` does not import triton
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

import math  # noqa: E402
import random  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eyas.kernels import (choose_num_splits, commit_tree_kv_reference, commit_tree_kv_triton,  # noqa: E402
                          merge_attention_states, paged_prefix_attention, split_tree_attention_triton,
                          tree_suffix_attention, write_kv_triton)
from eyas.layers.attention import (attend, merge_attention, prefix_attention, split_tree_attention,  # noqa: E402
                                   write_kv)

DEV = "cpu" if INTERPRET else "cuda"
TOL = dict(atol=1e-5, rtol=1e-5)
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                         reason="needs CUDA and compiled (not interpreted) Triton kernels")


# ----------------------------------------------------------------------------------------------------------------------
# Builders


def make_cache(B, KVH, D, page, ctx, dtype=torch.float32, spare=3, gen=None, int32_tables=False):
    """A paged cache with shuffled block ids; block 0 is never used (as in eyas). Returns k, v, tables, lens."""
    blocks_per_seq = max(1, max(math.ceil(c / page) for c in ctx))
    num_blocks = 1 + B * blocks_per_seq + spare
    k = torch.randn(num_blocks, page, KVH, D, generator=gen).to(dtype)
    v = torch.randn(num_blocks, page, KVH, D, generator=gen).to(dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen)[: B * blocks_per_seq] + 1).view(B, blocks_per_seq)
    tables = ids.to(torch.int32 if int32_tables else torch.int64)
    lens = torch.tensor(ctx, dtype=torch.int64)
    return k.to(DEV), v.to(DEV), tables.to(DEV), lens.to(DEV)


def tree_mask(B, Q, gen=None, empty_rows=0):
    """Ancestor masks (self included) of random trees whose parents precede their children: [B, Q, Q] bool.
    The last `empty_rows` rows see nothing (padding)."""
    m = torch.zeros(B, Q, Q, dtype=torch.bool)
    for b in range(B):
        for i in range(Q):
            m[b, i, i] = True
            if i:
                p = int(torch.randint(0, i, (1,), generator=gen))
                m[b, i] |= m[b, p]
        if empty_rows:
            m[b, Q - empty_rows:] = False
    return m.to(DEV)


def causal_mask(B, Q, P=0):
    return torch.ones(Q, P + Q, dtype=torch.bool).tril(P)[None].expand(B, Q, P + Q).contiguous().to(DEV)


def finite_close(a, b, **tol):
    """a and b agree where b is finite; where b is -inf, so is a."""
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    torch.testing.assert_close(a[fin], b[fin], **tol)


def ref_prefix(q, kc, vc, bt, cl, scale):
    return prefix_attention(q, kc, vc, bt.long(), cl, int(cl.max()), kc.shape[1], scale)


def dense_oracle(q, k_new, v_new, k_cache, v_cache, tables, lens, mask, scale):
    """SDPA over [prefix ; suffix] with one explicit boolean mask; the prefix is gathered slot by slot."""
    B, Q, H, D = q.shape
    page = k_cache.shape[1]
    Lp = max(1, int(lens.max()))
    kp = torch.zeros(B, Lp, *k_cache.shape[2:], dtype=torch.float32, device=q.device)
    vp = torch.zeros_like(kp)
    for b in range(B):
        for t in range(int(lens[b])):
            blk, off = int(tables[b, t // page]), t % page
            kp[b, t], vp[b, t] = k_cache[blk, off].float(), v_cache[blk, off].float()
    see_p = (torch.arange(Lp, device=q.device)[None, :] < lens[:, None])[:, None, :].expand(B, Q, Lp)
    k = torch.cat([kp, k_new.float()], 1).transpose(1, 2)
    v = torch.cat([vp, v_new.float()], 1).transpose(1, 2)
    full = torch.cat([see_p, mask], 2)[:, None]  # [B, 1, Q, Lp + L]
    o = F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, attn_mask=full, scale=scale,
                                       enable_gqa=True)
    return o.transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------------
# Prefix (paged, split)

PREFIX_CASES = [
    # B, Q, H, KVH, D, page, context lens, splits
    (3, 1, 4, 4, 32, 16, [0, 1, 37], 1),  # decode, G = 1, empty and single-entry contexts
    (3, 2, 8, 2, 64, 16, [16, 0, 50], 3),  # G = 4, a full block exactly
    (2, 3, 8, 1, 32, 8, [1, 45], 4),  # G = 8, block_size 8
    (2, 4, 4, 2, 128, 32, [70, 33], 2),  # head_dim 128, block_size 32
    (2, 2, 6, 3, 48, 16, [29, 0], 2),  # head_dim 48 (not a power of two), G = 2
    (1, 5, 2, 2, 80, 4, [61], None),  # head_dim 80, block_size 4, heuristic splits
    (1, 1, 4, 2, 32, 16, [5], 7),  # more splits than tiles: most splits are empty
    (2, 9, 16, 2, 32, 16, [40, 17], 2),  # Q * G = 72 rows > one 64-row tile (two row tiles)
]


@pytest.mark.parametrize("B,Q,H,KVH,D,page,ctx,splits", PREFIX_CASES)
def test_prefix_matches_reference(B, Q, H, KVH, D, page, ctx, splits):
    g = torch.Generator().manual_seed(B * 1000 + D + page)
    kc, vc, bt, cl = make_cache(B, KVH, D, page, ctx, gen=g, int32_tables=(D == 64))
    q = torch.randn(B, Q, H, D, generator=g).to(DEV)
    scale = D ** -0.5
    o, lse = paged_prefix_attention(q, kc, vc, bt, cl, scale, num_splits=splits)
    ro, rlse = ref_prefix(q, kc, vc, bt, cl, scale)
    assert o.dtype == lse.dtype == torch.float32 and o.shape == q.shape and lse.shape == q.shape[:3]
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o, ro, **TOL)
    finite_close(lse, rlse, **TOL)
    empty = cl == 0
    assert (o[empty] == 0).all() and (lse[empty] == float("-inf")).all()


def test_prefix_split_counts_agree():
    g = torch.Generator().manual_seed(7)
    kc, vc, bt, cl = make_cache(3, 2, 32, 16, [130, 1, 77], gen=g)
    q = torch.randn(3, 2, 4, 32, generator=g).to(DEV)
    o1, l1 = paged_prefix_attention(q, kc, vc, bt, cl, 0.2, num_splits=1)
    for s in (2, 3, 5, 9):
        o, l = paged_prefix_attention(q, kc, vc, bt, cl, 0.2, num_splits=s)
        torch.testing.assert_close(o, o1, **TOL)
        torch.testing.assert_close(l, l1, **TOL)


def test_prefix_noncontiguous_q_and_max_context_len():
    g = torch.Generator().manual_seed(3)
    kc, vc, bt, cl = make_cache(2, 2, 32, 16, [20, 35], gen=g)
    q = torch.randn(2, 4, 3, 32, generator=g).to(DEV).transpose(1, 2)  # [B, Q=3, H=4, D], strided
    assert not q.is_contiguous()
    o, lse = paged_prefix_attention(q, kc, vc, bt, cl, 0.3, max_context_len=35)
    ro, rlse = ref_prefix(q, kc, vc, bt, cl, 0.3)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(lse, rlse, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefix_half_caches(dtype):
    g = torch.Generator().manual_seed(11)
    kc, vc, bt, cl = make_cache(2, 2, 64, 16, [45, 3], dtype=dtype, gen=g)
    q = torch.randn(2, 2, 4, 64, generator=g).to(dtype).to(DEV)
    o, lse = paged_prefix_attention(q, kc, vc, bt, cl, 0.125, num_splits=2)
    ro, rlse = ref_prefix(q, kc, vc, bt, cl, 0.125)
    torch.testing.assert_close(lse, rlse, atol=1e-4, rtol=1e-4)  # exact products, fp32 sums
    torch.testing.assert_close(o, ro, atol=2e-2, rtol=2e-2)  # probabilities rounded to 16 bits for P @ V


@pytest.mark.parametrize("splits", [1, 3])
def test_outputs_in_the_model_dtype_are_the_float32_outputs_rounded(splits):
    """`out_dtype`: the prefix pass (reduced, or one split written directly) and the split tree attention return
    o in the model's dtype, equal to their float32 o cast once (what the layer's cast after them did)."""
    g = torch.Generator().manual_seed(12)
    B, Q, H, KVH, D = 2, 3, 4, 2, 32
    kc, vc, bt, cl = make_cache(B, KVH, D, 16, [40, 7], dtype=torch.bfloat16, gen=g)
    q = torch.randn(B, Q, H, D, generator=g).to(torch.bfloat16).to(DEV)
    o32, lse32 = paged_prefix_attention(q, kc, vc, bt, cl, 0.2, num_splits=splits)
    o16, lse16 = paged_prefix_attention(q, kc, vc, bt, cl, 0.2, num_splits=splits, out_dtype=torch.bfloat16)
    assert o32.dtype == torch.float32 and o16.dtype == torch.bfloat16 and lse16.dtype == torch.float32
    rounded_once(o16, o32)
    assert torch.equal(lse16, lse32)
    k = torch.randn(B, Q, KVH, D, generator=g).to(torch.bfloat16).to(DEV)
    v = torch.randn(B, Q, KVH, D, generator=g).to(torch.bfloat16).to(DEV)
    mask = tree_mask(B, Q, g)
    t32 = split_tree_attention_triton(q, k, v, kc, vc, bt, cl, mask, 0.2, num_splits=splits)
    t16 = split_tree_attention_triton(q, k, v, kc, vc, bt, cl, mask, 0.2, num_splits=splits,
                                      out_dtype=torch.bfloat16)
    assert t16.dtype == torch.bfloat16
    rounded_once(t16, t32)


def rounded_once(o16, o32):
    """o16 is o32 rounded to bf16: exactly on the GPU; the interpreter truncates instead of rounding to nearest, so
    there within one bf16 step (2^-7 relative)."""
    if INTERPRET:
        torch.testing.assert_close(o16.float(), o32, atol=1e-6, rtol=2 ** -7)
        assert (o16.float() - o32).abs().max() > 0  # it did round (a test that cannot tell would pass anything)
    else:
        assert torch.equal(o16, o32.to(torch.bfloat16))


def test_choose_num_splits():
    # batch 1, 8 kv heads, one row tile: ~4 waves of 132 SMs when the context is long enough
    assert choose_num_splits(8, 32768) == 64  # capped at 64 splits
    assert choose_num_splits(8, 1024) == 16  # capped by >= 64 tokens (one key tile) per split
    assert choose_num_splits(64, 4096) == 9  # batch 8: ceil(4 * 132 / 64)
    assert choose_num_splits(8, 100) == 1
    assert choose_num_splits(32 * 8, 1024) == 1  # a batch that has a program per SM: no reduction pass
    assert 1 <= choose_num_splits(1, 10 ** 7) <= 64
    assert choose_num_splits(0, 0) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefix_wide_key_tiles_on_one_split(dtype):
    """One split over a long context takes 128-key tiles (`_prefix_block_n`): same result as 64-key tiles and the
    reference."""
    from eyas.kernels.tree_attention import _prefix_block_n
    assert _prefix_block_n(16, 64, 64, 1, dtype, 600) == 128
    assert _prefix_block_n(16, 64, 64, 2, dtype, 600) == 64
    g = torch.Generator().manual_seed(12)
    kc, vc, bt, cl = make_cache(1, 2, 64, 16, [600], dtype=dtype, gen=g)
    q = torch.randn(1, 1, 4, 64, generator=g).to(dtype).to(DEV)
    o, lse = paged_prefix_attention(q, kc, vc, bt, cl, 0.125, num_splits=1)  # 128-key tiles
    o64, lse64 = paged_prefix_attention(q, kc, vc, bt, cl, 0.125, num_splits=1, block_n=64)
    ro, rlse = ref_prefix(q, kc, vc, bt, cl, 0.125)
    torch.testing.assert_close(lse, rlse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o, ro, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(o, o64, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------------------------------
# Suffix (tree mask)

SUFFIX_CASES = [
    # B, Q, P, H, KVH, D, mask kind
    (2, 7, 0, 4, 2, 32, "tree"),
    (2, 16, 0, 8, 1, 64, "tree"),  # G = 8
    (1, 20, 0, 2, 2, 128, "causal"),  # L = 20 > BLOCK_N tiles of 16? (BLOCK_N = 32 here) and D = 128
    (2, 5, 6, 4, 4, 48, "causal"),  # earlier tree tokens (P = 6) before the new ones, D = 48
    (2, 6, 0, 6, 2, 32, "empty"),  # tree with two padding rows that see nothing
    (1, 33, 0, 4, 2, 32, "tree"),  # Q * G = 66 rows: two row tiles, L = 33: two key tiles
]


def suffix_mask_for(kind, B, Q, P, g):
    if kind == "tree":
        return tree_mask(B, Q, g)
    if kind == "causal":
        return causal_mask(B, Q, P)
    return tree_mask(B, Q, g, empty_rows=2)


@pytest.mark.parametrize("B,Q,P,H,KVH,D,kind", SUFFIX_CASES)
def test_suffix_matches_reference(B, Q, P, H, KVH, D, kind):
    g = torch.Generator().manual_seed(Q * 100 + D)
    q = torch.randn(B, Q, H, D, generator=g).to(DEV)
    k = torch.randn(B, P + Q, KVH, D, generator=g).to(DEV)
    v = torch.randn(B, P + Q, KVH, D, generator=g).to(DEV)
    mask = suffix_mask_for(kind, B, Q, P, g)
    o, lse = tree_suffix_attention(q, k, v, mask, D ** -0.5)
    ro, rlse = attend(q, k, v, mask, D ** -0.5)
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o, ro, **TOL)
    finite_close(lse, rlse, **TOL)
    # the same mask as int8 gives the same result
    o8, _ = tree_suffix_attention(q, k, v, mask.to(torch.int8), D ** -0.5)
    torch.testing.assert_close(o8, o, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------------------
# Merge


@pytest.mark.parametrize("D", [32, 48, 128])
def test_merge_matches_reference(D):
    g = torch.Generator().manual_seed(D)
    shape = (3, 5, 4)
    o1, o2 = torch.randn(*shape, D, generator=g).to(DEV), torch.randn(*shape, D, generator=g).to(DEV)
    l1, l2 = (torch.randn(*shape, generator=g) * 4).to(DEV), (torch.randn(*shape, generator=g) * 4).to(DEV)
    l1[0, 0] = float("-inf")  # only the second part
    l2[1, 1] = float("-inf")  # only the first part
    l1[2, 2], l2[2, 2] = float("-inf"), float("-inf")  # neither
    o, lse = merge_attention_states(o1, l1, o2, l2)
    ro, rlse = merge_attention(o1, l1, o2, l2)
    fin = torch.isfinite(rlse)
    torch.testing.assert_close(o[fin], ro[fin], **TOL)
    finite_close(lse, rlse, **TOL)
    assert (o[2, 2] == 0).all() and (lse[2, 2] == float("-inf")).all()


# ----------------------------------------------------------------------------------------------------------------------
# Composed split tree attention

COMPOSED_CASES = [
    # B, Q, H, KVH, D, page, ctx, splits, P (earlier tree tokens)
    (3, 6, 4, 2, 32, 16, [0, 1, 37], 2, 0),
    (2, 8, 8, 1, 64, 16, [16, 53], None, 0),
    (2, 4, 4, 4, 128, 8, [9, 0], 3, 0),
    (1, 5, 6, 2, 48, 16, [31], 1, 3),
    (2, 1, 8, 2, 32, 32, [100, 64], 4, 0),  # plain decode: Q = 1
]


@pytest.mark.parametrize("B,Q,H,KVH,D,page,ctx,splits,P", COMPOSED_CASES)
def test_split_tree_attention_matches_reference_and_oracle(B, Q, H, KVH, D, page, ctx, splits, P):
    g = torch.Generator().manual_seed(Q * 31 + D + P)
    kc, vc, bt, cl = make_cache(B, KVH, D, page, ctx, gen=g)
    q = torch.randn(B, Q, H, D, generator=g).to(DEV)
    k_new = torch.randn(B, Q, KVH, D, generator=g).to(DEV)
    v_new = torch.randn(B, Q, KVH, D, generator=g).to(DEV)
    ks, vs = k_new, v_new
    if P:  # earlier tree tokens first in the suffix keys (as a draft level's stash rows)
        ks = torch.cat([torch.randn(B, P, KVH, D, generator=g).to(DEV), k_new], 1)
        vs = torch.cat([torch.randn(B, P, KVH, D, generator=g).to(DEV), v_new], 1)
        full = tree_mask(B, P + Q, g)
        mask = full[:, P:, :].contiguous()  # the new tokens are the last Q nodes of a P + Q node tree
    else:
        mask = tree_mask(B, Q, g)
    scale = D ** -0.5
    o = split_tree_attention_triton(q, ks, vs, kc, vc, bt, cl, mask, scale, num_splits=splits)
    meta = SimpleNamespace(use_triton=False, block_tables=bt, context_lens=cl, suffix_mask=mask, max_context_len=int(cl.max()),
                           block_size=page)
    ref = split_tree_attention(q, ks, vs, kc, vc, meta, scale)
    torch.testing.assert_close(o, ref, **TOL)
    torch.testing.assert_close(o, dense_oracle(q, ks, vs, kc, vc, bt, cl, mask, scale), **TOL)


@pytest.mark.parametrize("skip,suffix_first", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("tree", [False, True])
def test_splits_without_keys_store_nothing_and_are_not_read(monkeypatch, tree, skip, suffix_first):
    """A graph fixes the split count by the widest context it may see, so a shorter context leaves splits without
    keys. Where the partials are large (SKIP_EMPTY_BYTES; here 0), those splits store nothing and the reduction
    reads only the splits that the context gives keys; else every split stores its o and lse and the reduction
    reads them all. The partials' buffers are filled with NaN: the output must equal the reference (no NaN read),
    and exactly the empty splits' o and lse must still be NaN (not written) where they skip. SUFFIX_FIRST moves the
    tree's suffix programs to the front of the grid, not their partial."""
    import eyas.kernels.tree_attention as ta
    monkeypatch.setattr(ta, "SKIP_EMPTY_BYTES", 0 if skip else 1 << 62)
    monkeypatch.setattr(ta, "SUFFIX_FIRST", suffix_first)
    if suffix_first and not tree:
        pytest.skip("SUFFIX_FIRST is the tree grid's")
    bufs = []

    def nan_partials(shape, dtype, device):
        bufs.append(torch.full(shape, float("nan"), dtype=dtype, device=device))
        return bufs[-1]

    monkeypatch.setattr(ta, "_partials", nan_partials)
    g = torch.Generator().manual_seed(11)
    B, Q, H, KVH, D, page, S = 3, 3, 4, 2, 32, 16, 8
    ctx = [20, 0, 130]  # short contexts for 8 splits: most splits hold no key
    kc, vc, bt, cl = make_cache(B, KVH, D, page, ctx, gen=g)
    q = torch.randn(B, Q, H, D, generator=g).to(DEV)
    scale = D ** -0.5
    if tree:
        k_new = torch.randn(B, Q, KVH, D, generator=g).to(DEV)
        v_new = torch.randn(B, Q, KVH, D, generator=g).to(DEV)
        mask = tree_mask(B, Q, g)
        o = split_tree_attention_triton(q, k_new, v_new, kc, vc, bt, cl, mask, scale, num_splits=S)
        meta = SimpleNamespace(use_triton=False, block_tables=bt, context_lens=cl, suffix_mask=mask,
                               max_context_len=int(cl.max()), block_size=page)
        torch.testing.assert_close(o, split_tree_attention(q, k_new, v_new, kc, vc, meta, scale), **TOL)
    else:
        o, lse = paged_prefix_attention(q, kc, vc, bt, cl, scale, num_splits=S)
        ro, rlse = ref_prefix(q, kc, vc, bt, cl, scale)
        torch.testing.assert_close(o, ro, **TOL)
        finite_close(lse, rlse, **TOL)
    part, lse_part = bufs  # [B, S (+ 1 for the suffix), Q, H, D], [B, S (+ 1), Q, H]
    tile = ta._tiles(Q * H // KVH, D, kc.dtype)[1]  # the prefix's key tile (no wider tile: S > 1)
    for b, c in enumerate(ctx):  # whole tiles cut into S equal runs: splits 0 .. n-1 hold the keys
        tiles = -(-c // tile)
        n = -(-tiles // -(-tiles // S)) if tiles else 0
        assert n < S
        assert not part[b, :n].isnan().any() and not lse_part[b, :n].isnan().any()
        for x in (part, lse_part):
            assert x[b, n:S].isnan().all() if skip else not x[b, n:S].isnan().any()
        if tree:
            assert not part[b, S].isnan().any() and not lse_part[b, S].isnan().any()  # the suffix's partial


def test_max_context_len_chooses_the_split_count_else_the_table_width(monkeypatch):
    """The split count is chosen for `max_context_len` where the caller gives it (the engine's graphs: their
    context bucket), else for the block table's width; the output equals the reference either way."""
    import eyas.kernels.tree_attention as ta
    shapes = []

    def partials(shape, dtype, device):
        if len(shape) == 5:  # the o partials (the lse's are [B, S, Q, H])
            shapes.append(shape)
        return torch.empty(shape, dtype=dtype, device=device)

    monkeypatch.setattr(ta, "_partials", partials)
    g = torch.Generator().manual_seed(5)
    B, Q, H, KVH, D, page = 1, 2, 4, 2, 32, 16
    kc, vc, bt, cl = make_cache(B, KVH, D, page, [70], gen=g)
    bt = torch.cat([bt, torch.zeros(B, 40, dtype=bt.dtype, device=bt.device)], 1)  # a wide table: 45 blocks
    q = torch.randn(B, Q, H, D, generator=g).to(DEV)
    k_new = torch.randn(B, Q, KVH, D, generator=g).to(DEV)
    v_new = torch.randn(B, Q, KVH, D, generator=g).to(DEV)
    mask = tree_mask(B, Q, g)
    meta = SimpleNamespace(use_triton=False, block_tables=bt, context_lens=cl, suffix_mask=mask, max_context_len=70,
                           block_size=page)
    ref = split_tree_attention(q, k_new, v_new, kc, vc, meta, 0.2)
    m_tiles = -(-Q * H // KVH // ta._tiles(Q * H // KVH, D, kc.dtype)[0])
    for bound, tokens in ((None, bt.shape[1] * page), (128, 128)):
        o = split_tree_attention_triton(q, k_new, v_new, kc, vc, bt, cl, mask, 0.2, max_context_len=bound)
        torch.testing.assert_close(o, ref, **TOL)
        want = choose_num_splits(B * KVH * m_tiles, tokens, ta.device_sm_count(q.device))
        assert shapes[-1][1] == want + 1  # S prefix splits and the suffix
    assert shapes[0][1] > shapes[1][1]


def test_split_tree_attention_on_the_largest_fitted_tree():
    """The 128-node fitted tree (129 query rows with the root: several row tiles per head) through the Triton
    kernels, against the reference and the dense oracle."""
    from eyas.spec.tree import resolve_tree
    g = torch.Generator().manual_seed(128)
    mask1 = resolve_tree("tree:smollm2_128").ancestor_mask
    Q, H, KVH, D = mask1.shape[0], 4, 2, 32
    kc, vc, bt, cl = make_cache(2, KVH, D, 16, [37, 5], gen=g)
    q, k_new, v_new = (torch.randn(2, Q, n, D, generator=g).to(DEV) for n in (H, KVH, KVH))
    mask = mask1[None].expand(2, Q, Q).contiguous().to(DEV)
    scale = D ** -0.5
    o = split_tree_attention_triton(q, k_new, v_new, kc, vc, bt, cl, mask, scale, num_splits=2)
    meta = SimpleNamespace(use_triton=False, block_tables=bt, context_lens=cl, suffix_mask=mask,
                           max_context_len=int(cl.max()), block_size=16)
    torch.testing.assert_close(o, split_tree_attention(q, k_new, v_new, kc, vc, meta, scale), **TOL)
    torch.testing.assert_close(o, dense_oracle(q, k_new, v_new, kc, vc, bt, cl, mask, scale), **TOL)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16), B=st.integers(1, 3), Q=st.integers(1, 9), G=st.sampled_from([1, 2, 3, 8]),
       KVH=st.integers(1, 2), D=st.sampled_from([32, 64]), page=st.sampled_from([4, 16]),
       max_ctx=st.integers(0, 60), splits=st.sampled_from([None, 1, 2, 5]))
def test_split_tree_attention_random(seed, B, Q, G, KVH, D, page, max_ctx, splits):
    g = torch.Generator().manual_seed(seed)
    ctx = [int(torch.randint(0, max_ctx + 1, (1,), generator=g)) for _ in range(B)]
    kc, vc, bt, cl = make_cache(B, KVH, D, page, ctx, gen=g)
    H = G * KVH
    q = torch.randn(B, Q, H, D, generator=g).to(DEV)
    k_new = torch.randn(B, Q, KVH, D, generator=g).to(DEV)
    v_new = torch.randn(B, Q, KVH, D, generator=g).to(DEV)
    mask = tree_mask(B, Q, g)
    o = split_tree_attention_triton(q, k_new, v_new, kc, vc, bt, cl, mask, 0.17, num_splits=splits)
    torch.testing.assert_close(o, dense_oracle(q, k_new, v_new, kc, vc, bt, cl, mask, 0.17), **TOL)


# ----------------------------------------------------------------------------------------------------------------------
# KV writes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page,KVH,D", [(16, 2, 32), (8, 3, 48), (4, 1, 128)])
def test_write_kv_matches_reference(dtype, page, KVH, D):
    g = torch.Generator().manual_seed(page + D)
    nb, B, Q = 6, 3, 5
    kc = torch.randn(nb, page, KVH, D, generator=g).to(dtype).to(DEV)
    vc = torch.randn(nb, page, KVH, D, generator=g).to(dtype).to(DEV)
    big = torch.randn(B, Q, KVH + 1, D, generator=g).to(dtype).to(DEV)
    k = big[:, :, 1:]  # strided view
    v = torch.randn(B, Q, KVH, D, generator=g).to(dtype).to(DEV)
    slots = torch.randperm(nb * page - 1, generator=g)[: B * Q].view(B, Q) + 1  # slot 0 is scratch (block 0)
    slots[0, 1] = -1
    slots[2, 4] = -1
    slots = slots.to(DEV)
    kr, vr = kc.clone(), vc.clone()
    write_kv(kr, vr, k, v, slots)
    write_kv_triton(kc, vc, k, v, slots)
    # the reference dumps skipped rows into scratch slot 0, the kernel skips them: compare every other slot
    assert torch.equal(kc.flatten(0, 1)[1:], kr.flatten(0, 1)[1:])
    assert torch.equal(vc.flatten(0, 1)[1:], vr.flatten(0, 1)[1:])


def test_write_kv_casts_to_cache_dtype():
    g = torch.Generator().manual_seed(1)
    kc = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16, device=DEV)
    vc = torch.zeros_like(kc)
    k = torch.randn(2, 3, 2, 32, generator=g).to(DEV)
    v = torch.randn(2, 3, 2, 32, generator=g).to(DEV)
    slots = torch.tensor([[1, 2, 3], [40, -1, 63]], device=DEV)
    kr, vr = kc.clone(), vc.clone()
    write_kv(kr, vr, k, v, slots)
    write_kv_triton(kc, vc, k, v, slots)
    # the interpreter truncates float32 -> bf16 where torch and the GPU round to nearest: one bf16 step apart
    torch.testing.assert_close(kc.flatten(0, 1)[1:].float(), kr.flatten(0, 1)[1:].float(), atol=0, rtol=2 ** -7)
    torch.testing.assert_close(vc.flatten(0, 1)[1:].float(), vr.flatten(0, 1)[1:].float(), atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_tree_kv_matches_reference(dtype):
    g = torch.Generator().manual_seed(2)
    nb, page, KVH, D, B, N, depth = 5, 16, 2, 64, 3, 9, 4
    kc = torch.randn(nb, page, KVH, D, generator=g).to(dtype).to(DEV)
    vc = torch.randn(nb, page, KVH, D, generator=g).to(dtype).to(DEV)
    sk = torch.randn(B, N + 1, KVH, D, generator=g).to(dtype).to(DEV)
    sv = torch.randn(B, N + 1, KVH, D, generator=g).to(dtype).to(DEV)
    path = torch.tensor([[0, 2, 5, 9, -1], [0, 1, -1, -1, -1], [0, 3, 4, 8, 6]], device=DEV)
    slots = torch.tensor([[17, 18, 19, 20, -1], [33, 34, -1, -1, -1], [70, 71, -1, 72, 73]], device=DEV)
    kr, vr = kc.clone(), vc.clone()
    commit_tree_kv_reference(kr, vr, sk, sv, path, slots)
    commit_tree_kv_triton(kc, vc, sk, sv, path, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    # the reference does what it says
    flat = kr.view(-1, KVH, D)
    assert torch.equal(flat[19], sk[0, 5]) and torch.equal(flat[72], sk[2, 8]) and torch.equal(flat[34], sk[1, 1])
    assert torch.equal(flat[71], kc.view(-1, KVH, D)[71])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_tree_kv_all_layers_in_one_launch(dtype):
    """Caches [L, ...] and stashes [L, ...]: one launch commits each layer's own stash rows, as a layer-by-layer
    commit does."""
    g = torch.Generator().manual_seed(3)
    L, nb, page, KVH, D, B, N = 3, 6, 8, 2, 32, 2, 7
    kc = torch.randn(L, nb, page, KVH, D, generator=g).to(dtype).to(DEV)
    vc = torch.randn(L, nb, page, KVH, D, generator=g).to(dtype).to(DEV)
    sk = torch.randn(L, B, N + 1, KVH, D, generator=g).to(dtype).to(DEV)
    sv = torch.randn(L, B, N + 1, KVH, D, generator=g).to(dtype).to(DEV)
    path = torch.tensor([[0, 3, 6, -1], [0, 1, 2, 7]], device=DEV)
    slots = torch.tensor([[9, 10, 11, -1], [30, 31, 32, 33]], device=DEV)
    kr, vr, kq, vq = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    for layer in range(L):
        commit_tree_kv_triton(kr[layer], vr[layer], sk[layer], sv[layer], path, slots)
    commit_tree_kv_reference(kq, vq, sk, sv, path, slots)  # the reference, layered too
    commit_tree_kv_triton(kc, vc, sk, sv, path, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert torch.equal(kc, kq) and torch.equal(vc, vq)
    assert torch.equal(kc[2].view(-1, KVH, D)[11], sk[2, 0, 6]) and torch.equal(vc[1].view(-1, KVH, D)[33], sv[1, 1, 7])
    with pytest.raises(ValueError, match="layers"):
        commit_tree_kv_triton(kc, vc, sk[:2], sv[:2], path, slots)


# ----------------------------------------------------------------------------------------------------------------------
# GPU: compiled kernels, bf16, many random shapes (run on an H200; skipped here)


# (KVH, G, D, page): the compile-time constants of the kernels come from a small pool (SmolLM2's 3 x 3 x 64, Llama 8B's
# 8 x 4 x 128, two odd ones), so a GPU run compiles a few dozen variants instead of one per case; batch, tree size,
# context lengths, splits and masks stay random.
GPU_SHAPES = [(3, 3, 64, 16), (8, 4, 128, 16), (1, 7, 96, 8), (2, 1, 32, 32)]


def _random_case(rng: random.Random, dtype):
    B = rng.choice([1, 2, 3, 8])
    Q = rng.choice([1, 2, 5, 16, 32, 60, 64])
    KVH, G, D, page = rng.choice(GPU_SHAPES)
    ctx = [rng.choice([0, 1, rng.randint(1, 300), rng.randint(300, 5000)]) for _ in range(B)]
    splits = rng.choice([None, None, 1, 3, 16])
    gen = torch.Generator().manual_seed(rng.randint(0, 2 ** 30))
    kc, vc, bt, cl = make_cache(B, KVH, D, page, ctx, dtype=dtype, gen=gen)
    H = G * KVH
    q = torch.randn(B, Q, H, D, generator=gen).to(dtype).to(DEV)
    k_new = torch.randn(B, Q, KVH, D, generator=gen).to(dtype).to(DEV)
    v_new = torch.randn(B, Q, KVH, D, generator=gen).to(dtype).to(DEV)
    mask = tree_mask(B, Q, gen) if rng.random() < 0.7 else causal_mask(B, Q)
    return q, k_new, v_new, kc, vc, bt, cl, mask, D ** -0.5, splits


@gpu
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3), (torch.float32, 2e-5)])
def test_gpu_random_shapes(dtype, atol):
    rng = random.Random(1234)
    for _ in range(60):
        q, k_new, v_new, kc, vc, bt, cl, mask, scale, splits = _random_case(rng, dtype)
        o = split_tree_attention_triton(q, k_new, v_new, kc, vc, bt, cl, mask, scale, num_splits=splits,
                                        max_context_len=int(cl.max()))
        meta = SimpleNamespace(use_triton=False, block_tables=bt, context_lens=cl, suffix_mask=mask, max_context_len=int(cl.max()),
                               block_size=kc.shape[1])
        ref = split_tree_attention(q, k_new, v_new, kc, vc, meta, scale)
        torch.testing.assert_close(o, ref, atol=atol, rtol=atol)
        po, plse = paged_prefix_attention(q, kc, vc, bt, cl, scale, num_splits=splits)
        ro, rlse = ref_prefix(q, kc, vc, bt, cl, scale)
        torch.testing.assert_close(po, ro, atol=atol, rtol=atol)
        finite_close(plse, rlse, atol=atol, rtol=atol)
        so, slse = tree_suffix_attention(q, k_new, v_new, mask, scale)
        rso, rslse = attend(q, k_new, v_new, mask, scale)
        torch.testing.assert_close(so, rso, atol=atol, rtol=atol)
        finite_close(slse, rslse, atol=atol, rtol=atol)


@gpu
def test_gpu_kv_write_and_commit_bf16():
    g = torch.Generator().manual_seed(0)
    nb, page, KVH, D, B, Q = 64, 16, 8, 128, 4, 64
    kc = torch.zeros(nb, page, KVH, D, dtype=torch.bfloat16, device=DEV)
    vc = torch.zeros_like(kc)
    k = torch.randn(B, Q, KVH, D, generator=g).to(DEV)
    v = torch.randn(B, Q, KVH, D, generator=g).to(DEV)
    slots = (torch.randperm(nb * page - 1, generator=g)[: B * Q] + 1).view(B, Q).to(DEV)  # slot 0 is scratch
    slots[:, -3:] = -1
    kr, vr = kc.clone(), vc.clone()
    write_kv(kr, vr, k, v, slots)
    write_kv_triton(kc, vc, k, v, slots)
    # round-to-nearest on both sides; the reference dumps skipped rows into scratch slot 0, the kernel skips them
    assert torch.equal(kc.flatten(0, 1)[1:], kr.flatten(0, 1)[1:])
    assert torch.equal(vc.flatten(0, 1)[1:], vr.flatten(0, 1)[1:])
    kr, vr = kc.clone(), vc.clone()
    sk, sv = k.to(torch.bfloat16), v.to(torch.bfloat16)
    path = torch.randint(-1, Q, (B, 7), generator=g).to(DEV)
    cslots = torch.randint(-1, nb * page, (B, 7), generator=g).to(DEV)
    cslots = torch.where(cslots >= 0, torch.arange(B * 7, device=DEV).view(B, 7) * 3, cslots)  # distinct slots
    commit_tree_kv_reference(kr, vr, sk, sv, path, cslots)
    commit_tree_kv_triton(kc, vc, sk, sv, path, cslots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@gpu
def test_gpu_cuda_graph_capture():
    """The composed kernel reads nothing back from the device, so a CUDA graph can hold it."""
    rng = random.Random(7)
    q, k_new, v_new, kc, vc, bt, cl, mask, scale, _ = _random_case(rng, torch.bfloat16)
    run = lambda: split_tree_attention_triton(q, k_new, v_new, kc, vc, bt, cl, mask, scale)  # noqa: E731
    expect = run()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, run(), atol=0, rtol=0)
    assert not torch.equal(out, expect)
