"""Split tree attention (prefix over the paged cache + suffix under the tree mask, merged by log-sum-exp) equals one
dense masked attention over [prefix ; tree] computed by torch's scaled_dot_product_attention."""
import pytest
import torch
import torch.nn.functional as F

from eyas.layers.attention import AttentionMetadata, split_tree_attention
from eyas.spec.tree import PRESETS, Tree


def dense_oracle(q, k_all, v_all, mask, scale):
    """SDPA over explicit keys with a boolean mask; q [B,Q,H,D], k [B,L,KVH,D], mask [B,Q,L]."""
    H, KVH = q.shape[2], k_all.shape[2]
    k = k_all.repeat_interleave(H // KVH, dim=2)
    v = v_all.repeat_interleave(H // KVH, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2).double(), k.transpose(1, 2).double(),
                                       v.transpose(1, 2).double(), attn_mask=mask[:, None], scale=scale)
    return o.transpose(1, 2)


def random_tree(gen: torch.Generator, n: int) -> Tree:
    paths = [(0,)]
    while len(paths) < n:
        parent = paths[int(torch.randint(len(paths) + 1, (1,), generator=gen)) - 1] if paths else ()
        parent = parent if torch.rand(1, generator=gen) < 0.8 else ()
        rank = int(torch.randint(3, (1,), generator=gen))
        p = tuple(parent) + (rank,)
        if p not in paths:
            paths.append(p)
    return Tree.from_paths([list(p) for p in paths])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32), (6, 3, 64)])
def test_split_equals_dense(seed, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(seed)
    block_size = 4
    tree = random_tree(gen, 3 + seed * 3) if seed % 2 else Tree.from_paths(PRESETS["mc_sim_7b_63"])
    N1 = tree.num_nodes + 1
    context_lens = torch.tensor([0, 1, 5, 13][: 2 + seed % 3])  # 0, lengths not multiples of the block size
    B = len(context_lens)
    num_blocks = 1 + B * 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # scattered blocks
    block_tables = perm[: B * 4].view(B, 4)
    q = torch.randn(B, N1, heads, head_dim, generator=gen)
    k_new = torch.randn(B, N1, kv_heads, head_dim, generator=gen)
    v_new = torch.randn(B, N1, kv_heads, head_dim, generator=gen)
    mask = tree.ancestor_mask[None].expand(B, N1, N1)
    meta = AttentionMetadata(block_tables=block_tables, context_lens=context_lens, suffix_mask=mask,
                             max_context_len=int(context_lens.max()), block_size=block_size)
    scale = head_dim ** -0.5
    out = split_tree_attention(q, k_new, v_new, k_cache, v_cache, meta, scale)

    # oracle: gather each sequence's prefix by hand, pad, one attention over [prefix ; tree]
    L = int(context_lens.max())
    kp = torch.zeros(B, L, kv_heads, head_dim)
    vp = torch.zeros(B, L, kv_heads, head_dim)
    for b in range(B):
        for pos in range(int(context_lens[b])):
            blk, off = block_tables[b, pos // block_size], pos % block_size
            kp[b, pos], vp[b, pos] = k_cache[blk, off], v_cache[blk, off]
    prefix_visible = (torch.arange(L)[None, :] < context_lens[:, None])[:, None, :].expand(B, N1, L)
    ref = dense_oracle(q, torch.cat([kp, k_new], 1), torch.cat([vp, v_new], 1),
                       torch.cat([prefix_visible, mask], -1), scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_tree_structure():
    t = Tree.from_paths(PRESETS["mc_sim_7b_63"])
    assert t.num_nodes == 25 and t.max_depth == 5
    assert Tree.chain(4).num_nodes == 4 and Tree.chain(4).max_depth == 4
    # the ancestor mask is the transitive closure of `parents`
    for i in range(1, 26):
        anc = {i}
        j = int(t.parents[i])
        while j >= 0:
            anc.add(j)
            j = int(t.parents[j])
        assert set(torch.nonzero(t.ancestor_mask[i]).flatten().tolist()) == anc
        assert int(t.depth[i]) == len(t.paths[i - 1])
    with pytest.raises(ValueError, match="no parent"):
        Tree.from_paths([[0], [1, 0]])


def test_resolve_tree_specs(tmp_path):
    from eyas.spec.tree import resolve_tree
    assert resolve_tree(None) is None
    assert resolve_tree("chain:3").num_nodes == 3
    assert resolve_tree("tree:16").num_nodes == 16 and resolve_tree("tree:8").num_nodes == 8
    f = tmp_path / "t.json"
    f.write_text("[[0], [1], [0, 0], [0, 1], [0, 0, 0]]")
    t = resolve_tree(str(f))
    assert t.num_nodes == 5 and t.max_depth == 3 and t.topk_per_level == [2, 2, 1, 0]
    # the file as tree:PATH too (what a preset's spelling suggests)
    assert resolve_tree(f"tree:{f}").paths == t.paths
    for bad, msg in (("chain:x", "integer"), ("tree:nope", "preset"), (str(tmp_path / "missing.json"), "exist"),
                     (f"tree:{tmp_path / 'missing.json'}", "exist")):
        with pytest.raises(ValueError, match=msg):
            resolve_tree(bad)
    f.write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        resolve_tree(str(f))


@pytest.mark.parametrize("use_triton", [False, True])
def test_plain_step_prefix_pass_equals_the_split(use_triton):
    """Plain decoding (`AttentionMetadata.prefix_includes_new`): the layer writes the token's K/V to the cache, then
    one prefix pass over n + 1 entries; the result equals the split attention over the n cached entries plus the
    token itself, and the caches agree afterwards (reference path; Triton on a GPU, or under the interpreter)."""
    from types import SimpleNamespace
    from eyas.config import ModelConfig
    from eyas.layers.attention import MetaBuilder
    from eyas.layers.rotary import RotaryEmbedding
    from eyas.models.llama import Attention
    dev = "cuda" if use_triton and torch.cuda.is_available() else "cpu"
    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    attn = Attention(cfg, 0).eval().to(dev)
    rope = RotaryEmbedding.for_config(cfg).to(dev)
    B, bs = 3, 4
    n = torch.tensor([0, 5, 12], device=dev)
    block_tables = (torch.randperm(12, generator=gen) + 1)[: B * 4].view(B, 4).to(dev)
    k0 = torch.randn(1, 14, bs, 2, 8, generator=gen).to(dev)
    v0 = torch.randn(1, 14, bs, 2, 8, generator=gen).to(dev)
    x = torch.randn(B, 1, 32, generator=gen).to(dev)
    pos = n[:, None]
    mb = MetaBuilder(block_tables, bs, int(n.max()), use_triton)
    mask = torch.ones(B, 1, 1, dtype=torch.bool, device=dev)
    slots = mb.slots(pos, torch.ones(B, 1, dtype=torch.bool, device=dev))
    split_cache = SimpleNamespace(k=k0.clone(), v=v0.clone())
    one_cache = SimpleNamespace(k=k0.clone(), v=v0.clone())
    with torch.no_grad():
        want = attn(x, pos, rope, mb(n, mask, slot_mapping=slots), split_cache)
        got = attn(x, pos, rope, mb(n + 1, mask, max_context_len=int(n.max()) + 1, prefix_includes_new=True,
                                    slot_mapping=slots), one_cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(one_cache.k, split_cache.k) and torch.equal(one_cache.v, split_cache.v)
