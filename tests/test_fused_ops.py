"""The inference fast path (issue #5) against the eager reference: the fused Triton kernels (residual add + RMSNorm,
RoPE, SwiGLU) against their plain-PyTorch references, fused projections against the unfused model, the model with
the fused ops against the model without, and greedy generation through the engine.

Without CUDA the kernels run under the Triton interpreter (CPU). On a GPU machine, without TRITON_INTERPRET, the same
tests run the compiled kernels, and the `gpu` test (bf16, model-sized shapes) runs too:

    .venv/bin/python -m pytest -q tests/test_fused_ops.py
"""
import copy
import os

import torch

if not torch.cuda.is_available():  # before Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

import pytest  # noqa: E402

from eyas import LLM, SamplingParams  # noqa: E402
from eyas.config import ModelConfig  # noqa: E402
from eyas.kernels import (add_rms_norm_reference, add_rms_norm_triton, draft_pairs_reference,  # noqa: E402
                          draft_pairs_triton, rope_reference, rope_store_reference, rope_store_triton, rope_triton,
                          swiglu_reference, swiglu_triton)
from eyas.layers.norm import RMSNorm  # noqa: E402
from eyas.layers.rotary import RotaryEmbedding  # noqa: E402
from eyas.models.eagle import EagleDraft  # noqa: E402
from eyas.models.fused import enable_fast_path, fuse_projections, hf_state_dict, use_fused_ops  # noqa: E402
from eyas.models.llama import LlamaForCausalLM  # noqa: E402
from helpers import SHORT_CONTEXT, write_random_draft, write_tiny_llama  # noqa: E402

DEV = "cpu" if INTERPRET else "cuda"
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                         reason="needs CUDA and compiled (not interpreted) Triton kernels")
# fp32: tight. bf16: the interpreter rounds float32 -> bf16 by truncation, and the sum of squares is reduced in
# another order, so allow one bf16 step (2^-7 relative)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def close(a, b, dtype):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


# ---- kernels vs references ---------------------------------------------------------------------------------------
def test_references_are_the_model_code():
    """The references the kernels are held to compute what the eager modules compute, bit for bit."""
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 5, 24, generator=g), torch.randn(3, 5, 24, generator=g)
    norm = RMSNorm(24, 1e-6)
    norm.weight.data = torch.randn(24, generator=g)
    normed, new_r = add_rms_norm_reference(x, r, norm.weight, norm.eps)
    assert torch.equal(new_r, r + x) and torch.equal(normed, norm(r + x))
    rope = RotaryEmbedding(16, 64, 500000.0, {"factor": 8.0, "original_max_position_embeddings": 32})
    pos = torch.randint(0, 64, (3, 5), generator=g)
    q, k = torch.randn(3, 5, 4, 16, generator=g), torch.randn(3, 5, 2, 16, generator=g)
    for a, b in zip(rope_reference(pos, q, k, rope.cos, rope.sin), rope(pos, q, k)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(1)
    H = 40  # not a power of two: masked tail
    x = (torch.randn(2, 3, H, generator=g) * 3).to(DEV, dtype)
    res = torch.randn(2, 3, H, generator=g).to(DEV, dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(DEV, dtype)
    for r in (None, res):
        out, new_r = add_rms_norm_triton(x, r, w, 1e-6)
        ref_out, ref_r = add_rms_norm_reference(x, r, w, 1e-6)
        close(out, ref_out, dtype)
        close(new_r, ref_r, dtype)
        if r is None:
            assert new_r is x
    # a strided input (every other row of a bigger buffer)
    big = torch.randn(4, H, generator=g).to(DEV, dtype)
    close(add_rms_norm_triton(big[::2], None, w, 1e-5)[0], add_rms_norm_reference(big[::2], None, w, 1e-5)[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_on_views_of_a_fused_qkv(dtype):
    g = torch.Generator().manual_seed(2)
    B, Q, H, KVH = 2, 3, 4, 2
    for D in (16, 24):  # 24: half = 12, masked tile
        rope = RotaryEmbedding(D, 100, 10000.0, None).to(DEV)
        pos = torch.randint(0, 100, (B, Q), generator=g).to(DEV)
        qkv = (torch.randn(B, Q, (H + 2 * KVH) * D, generator=g) * 2).to(DEV, dtype)
        q, k, _ = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        q, k = q.view(B, Q, H, D), k.view(B, Q, KVH, D)  # strided, as the fused projection gives them
        qo, ko = rope_triton(pos, q, k, rope.cos, rope.sin)
        rq, rk = rope_reference(pos, q, k, rope.cos, rope.sin)
        close(qo, rq, dtype)
        close(ko, rk, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_to_cache_slots_and_stash_rows(dtype):
    """RoPE with the K/V store fused in (plain decoding's cache write, tree tokens' stash) equals RoPE followed by
    the store: the same rotated q, rotated k and v at the asked rows, nothing else touched, a skipped slot skipped."""
    g = torch.Generator().manual_seed(5)
    B, Q, H, KVH = 3, 4, 6, 2
    for D in (16, 24):
        rope = RotaryEmbedding(D, 200, 10000.0, None).to(DEV)
        pos = torch.randint(0, 200, (B, Q), generator=g).to(DEV)
        qkv = (torch.randn(B, Q, (H + 2 * KVH) * D, generator=g) * 2).to(DEV, dtype)
        q, k, v = (t.view(B, Q, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
        rq, rk = rope_reference(pos, q, k, rope.cos, rope.sin)
        # a cache layer's flat slots: a permutation of rows >= 1, one token skipped (-1)
        R = 40
        rows = (torch.randperm(R - 1, generator=g)[: B * Q] + 1).view(B, Q).to(DEV)
        rows[1, 2] = -1
        for store in ("slots", "stash"):
            kd0 = torch.randn(R, KVH, D, generator=g).to(DEV, dtype)
            vd0 = torch.randn(R, KVH, D, generator=g).to(DEV, dtype)
            where = dict(rows=rows) if store == "slots" else dict(seq_rows=9, row_offset=3)
            kd, vd, kr, vr = kd0.clone(), vd0.clone(), kd0.clone(), vd0.clone()
            qo = rope_store_triton(pos, q, k, v, rope.cos, rope.sin, kd, vd, **where)
            qr = rope_store_reference(pos, q, k, v, rope.cos, rope.sin, kr, vr, **where)
            close(qo, rq, dtype)
            close(qr, rq, dtype)
            if store == "slots":
                dst = rows.clamp(min=0)
                ok = rows >= 0
                close(kd[dst[ok]], rk[ok], dtype)
                assert torch.equal(vd[dst[ok]], v[ok])
                untouched = torch.ones(R, dtype=torch.bool, device=DEV)
                untouched[dst[ok]] = False
                assert torch.equal(kd[untouched], kd0[untouched]) and torch.equal(vd[untouched], vd0[untouched])
                kr[0], vr[0] = kd0[0], vd0[0]  # the reference sends skipped rows to scratch row 0; the kernel skips
            else:
                at = (torch.arange(B, device=DEV)[:, None] * 9 + 3 + torch.arange(Q, device=DEV)).view(-1)
                close(kd[at], rk.reshape(-1, KVH, D), dtype)
                assert torch.equal(vd[at], v.reshape(-1, KVH, D))
            close(kd, kr, dtype)
            assert torch.equal(vd, vr)
    with pytest.raises(ValueError, match="seq_rows"):
        rope_store_triton(pos, q, k, v, rope.cos, rope.sin, kd, vd, seq_rows=4, row_offset=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_on_halves_of_a_fused_gate_up(dtype):
    g = torch.Generator().manual_seed(3)
    for I in (48, 1100):  # 1100: two column tiles of 1024, the second masked
        gu = (torch.randn(3, 2 * I, generator=g) * 3).to(DEV, dtype)
        gate, up = gu.chunk(2, dim=-1)
        close(swiglu_triton(gate, up), swiglu_reference(gate, up), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_and_swiglu_apply_a_folded_norm(dtype):
    """With `norm_x` (a model with folded norm weights) the RoPE + store and SwiGLU kernels scale each token's q, k, v
    (gate, up) by the 1/rms of its residual row first: equal to their references, and, in float32, to the
    projections of the normalised rows (the same linear maps applied after the norm)."""
    g = torch.Generator().manual_seed(6)
    B, Q, H, KVH, D, HX = 2, 3, 4, 2, 16, 40  # HX: a residual row that is not a power of two (masked)
    rope = RotaryEmbedding(D, 100, 10000.0, None).to(DEV)
    pos = torch.randint(0, 100, (B, Q), generator=g).to(DEV)
    x = (torch.randn(B, Q, HX, generator=g) * 3).to(DEV, dtype)
    w_qkv = (torch.randn((H + 2 * KVH) * D, HX, generator=g) / HX ** 0.5).to(DEV, dtype)
    q, k, v = (t.view(B, Q, -1, D) for t in (x @ w_qkv.t()).split([H * D, KVH * D, KVH * D], dim=-1))
    R = B * 5
    outs = {}
    for name, fn in (("triton", rope_store_triton), ("ref", rope_store_reference)):
        kd, vd = torch.zeros(R, KVH, D, device=DEV, dtype=dtype), torch.zeros(R, KVH, D, device=DEV, dtype=dtype)
        qo = fn(pos, q, k, v, rope.cos, rope.sin, kd, vd, seq_rows=5, row_offset=1, norm_x=x, eps=1e-6)
        outs[name] = (qo, kd, vd)
    for a, b in zip(*outs.values()):
        close(a, b, dtype)
    I = 24
    w_gu = (torch.randn(2 * I, HX, generator=g) / HX ** 0.5).to(DEV, dtype)
    gate, up = (x @ w_gu.t()).chunk(2, dim=-1)
    act = swiglu_triton(gate, up, norm_x=x, eps=1e-6)
    close(act, swiglu_reference(gate, up, norm_x=x, eps=1e-6), dtype)
    if dtype == torch.float32:  # the oracle: the unscaled kernels on the projections of rms-normalised rows
        from eyas.layers.norm import rms_normalize
        n = rms_normalize(x, 1e-6)
        nq, nk, nv = (t.view(B, Q, -1, D) for t in (n @ w_qkv.t()).split([H * D, KVH * D, KVH * D], dim=-1))
        kd, vd = torch.zeros(R, KVH, D, device=DEV), torch.zeros(R, KVH, D, device=DEV)
        qo = rope_store_reference(pos, nq, nk, nv, rope.cos, rope.sin, kd, vd, seq_rows=5, row_offset=1)
        for a, b in zip((qo, kd, vd), outs["triton"]):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(act, swiglu_reference(*(n @ w_gu.t()).chunk(2, dim=-1)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="norm_x"):
        rope_store_triton(pos, q, k, v, rope.cos, rope.sin, kd, vd, seq_rows=5, row_offset=1, norm_x=x[:, :2])
    with pytest.raises(ValueError, match="norm_x"):
        swiglu_triton(gate, up, norm_x=x[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_pairs_tree_level_and_catch_up(dtype):
    """The draft's input pairs in one launch equal the reference, and the reference is the plain gathers and cat:
    a tree level (tokens picked from a flat top-k, written to a column slice of node_tokens, parents' features),
    a deepest level (tokens only), and the catch-up (every row, features from a per-slot buffer in float32)."""
    g = torch.Generator().manual_seed(5)
    V, H, B = 40, 1100, 3  # H: a masked second tile of 1024
    embed = torch.randn(V, H, generator=g).to(DEV, dtype)
    top = torch.randint(0, V, (B, 3, 2), generator=g).to(DEV)  # [B, parents, k]
    pick = torch.tensor([0, 1, 2, 4, 5], device=DEV)  # parent * k + rank of each child
    node_h = torch.randn(B, 9, H, generator=g).to(DEV, dtype)
    par_abs = torch.tensor([1, 1, 2, 3, 3], device=DEV)
    toks = {}
    for name, fn in (("triton", draft_pairs_triton), ("ref", draft_pairs_reference)):
        node_tokens = torch.full((B, 9), -1, dtype=torch.long, device=DEV)
        pairs = fn(embed, top.flatten(1), pick, node_h, par_abs, tok_out=node_tokens[:, 4:9])
        toks[name] = (node_tokens, pairs)
        none = fn(embed, top.flatten(1), pick, tok_out=node_tokens[:, 4:9], pairs=False)
        assert none is None
    ids = top.flatten(1)[:, pick]
    assert torch.equal(toks["ref"][0][:, 4:], ids) and (toks["ref"][0][:, :4] == -1).all()
    assert torch.equal(toks["triton"][0], toks["ref"][0])
    assert torch.equal(toks["ref"][1], torch.cat([embed[ids], node_h[:, par_abs]], -1))
    close(toks["triton"][1], toks["ref"][1], dtype)
    # catch-up: tokens [B, P] as they are, features rows slots[b] of a [num_slots, P, H] float32 buffer
    tokens = torch.randint(0, V, (B, 4), generator=g).to(DEV)
    buf = torch.randn(5, 4, H, generator=g).to(DEV)
    slots = torch.tensor([3, 0, 4], device=DEV)
    ref = draft_pairs_reference(embed, tokens, feats=buf, feat_rows=slots)
    assert torch.equal(ref, torch.cat([embed[tokens], buf[slots].to(dtype)], -1))
    close(draft_pairs_triton(embed, tokens, feats=buf, feat_rows=slots), ref, dtype)


def test_draft_pairs_with_pdl_compiles_for_sm90():
    """`eyas.kernels.draft_pairs.PDL`'s variant (on by default since session 40) compiles for sm_90
    (offline), each program letting the draft's fc launch and then waiting before it reads (PTX order)."""
    pytest.importorskip("triton.compiler")
    from helpers import compile_for_sm90
    sig = {"EMB": "*bf16", "TOK": "*i64", "TOK_IDX": "*i64", "FEAT": "*bf16", "FEAT_IDX": "*i64",
           "FEAT_ROWS": "*i64", "OUT": "*bf16", "TOK_OUT": "*i64", "Q": "i32", "H": "i32"}
    sig.update({k: "i32" for k in ("stride_e", "stride_tb", "stride_tt", "stride_ff", "stride_fr", "stride_fh",
                                   "stride_ob", "stride_oq", "stride_kb", "stride_kq")})
    consts = dict(HAS_TOK_IDX=True, HAS_FEAT_IDX=True, HAS_FEAT_ROWS=True, WRITE_TOK=True, WRITE_PAIRS=True,
                  BLOCK_H=1024, USE_GDC=True)
    sig.update({k: "constexpr" for k in consts})
    (r,) = compile_for_sm90([("eyas.kernels.draft_pairs", "_draft_pairs_kernel", sig, consts, {"num_warps": 4})])
    assert r["error"] is None, r["error"]
    assert r["gdc"] == ["launch_dependents", "wait"]


# ---- models ------------------------------------------------------------------------------------------------------
def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=50, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6, max_position_embeddings=64)
    base.update(kw)
    return ModelConfig(**base)


def randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (2 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.3)
                    + (1.0 if p.dim() == 1 and p.shape[0] == model.config.hidden_size else 0.0))
    return model.eval()


def inputs(B=2, Q=7, V=50, seed=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, Q), generator=g), torch.arange(Q).repeat(B, 1) + 3


@pytest.mark.parametrize("bias", [False, True])
def test_fuse_projections_keeps_the_logits(bias):
    model = randomize(LlamaForCausalLM(tiny_config(attention_bias=bias, mlp_bias=bias)))
    ids, pos = inputs()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model.compute_logits(model(ids, pos))
        fuse_projections(model)
        out = model.compute_logits(model(ids, pos))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert hasattr(attn, "qkv_proj") and not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    back = hf_state_dict(model)  # the HF names and tensors again
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_tensor_parallel_refuses_a_fused_model():
    from eyas.dist.tp import apply_tensor_parallel
    model = fuse_projections(LlamaForCausalLM(tiny_config()))
    with pytest.raises(ValueError, match="before fusing"):
        apply_tensor_parallel(model, 0, 2)


def test_save_draft_of_a_fused_draft_writes_hf_names(tmp_path):
    from safetensors.torch import load_file

    from eyas.loader.eagle import save_draft
    draft = randomize(EagleDraft(tiny_config(num_hidden_layers=1)))
    want = {k: v.clone() for k, v in draft.state_dict().items() if not k.startswith("rope.")}
    fuse_projections(draft)
    got = load_file(str(save_draft(draft, tmp_path, dtype=torch.float32) / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_fused_ops_model_equals_reference():
    """Whole target and a two-layer draft (layer 0 without input norm), fused kernels on vs off, float32."""
    model = randomize(LlamaForCausalLM(tiny_config()).to(DEV))
    ids, pos = inputs()
    ids, pos = ids.to(DEV), pos.to(DEV)
    draft = randomize(EagleDraft(tiny_config()).to(DEV), seed=5)
    emb = model.embed(ids)
    with torch.no_grad():
        ref_h = model(ids, pos)
        ref_d = draft(emb, ref_h, pos)
        enable_fast_path(model)
        enable_fast_path(draft)
        h = model(ids, pos)
        d = draft(emb, ref_h, pos)  # the same input as the reference draft
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.compute_logits(h), model.compute_logits(ref_h), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(d, ref_d, atol=1e-5, rtol=1e-5)
    # the target ran with its norm weights folded into the projections (forward_folded); the draft is not folded
    assert model.norms_folded and all((layer.input_layernorm.weight == 1).all() for layer in model.model.layers)
    assert not getattr(draft, "norms_folded", False)


def test_fold_norms_refuses_hooked_projections_and_is_idempotent():
    """A row-parallel projection all-reduces in a forward hook (tensor parallelism), which an in-GEMM residual add
    would skip: such a model is not folded. Folding twice changes nothing; `fold=False` after a fold keeps the
    folded weights and takes `forward_fused` again, with the same output."""
    from eyas.models.fused import can_fold_norms, fold_norms
    ids, pos = inputs()
    hooked = fuse_projections(randomize(LlamaForCausalLM(tiny_config())))
    hooked.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: out)
    before = {k: v.clone() for k, v in hooked.state_dict().items()}
    assert not can_fold_norms(hooked) and not fold_norms(hooked).norms_folded
    assert all(torch.equal(v, before[k]) for k, v in hooked.state_dict().items())
    assert not can_fold_norms(randomize(LlamaForCausalLM(tiny_config())))  # q/k/v not fused yet
    pre = fuse_projections(randomize(LlamaForCausalLM(tiny_config())))
    pre.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a: a)  # a pre-hook must run too
    assert not can_fold_norms(pre)
    model = randomize(LlamaForCausalLM(tiny_config()).to(DEV))
    with torch.no_grad():
        ref = model(ids.to(DEV), pos.to(DEV))
        enable_fast_path(model)
        once = {k: v.clone() for k, v in model.state_dict().items()}
        fold_norms(model)
        assert all(torch.equal(v, once[k]) for k, v in model.state_dict().items())
        enable_fast_path(model, fold=False)
        assert not model.norms_folded
        torch.testing.assert_close(model(ids.to(DEV), pos.to(DEV)), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
def test_fused_draft_writes_out_views(layers):
    """The fused draft's last layer returns output + residual through `out`: a contiguous view (the norm writes the
    residual there and the down projection adds into it) or a strided one (a copy); both equal the reference, and
    nothing outside the view moves. Layer 0 has no input norm, so with one layer it is also the last."""
    draft = randomize(EagleDraft(tiny_config(num_hidden_layers=layers)).to(DEV), seed=7)
    g = torch.Generator().manual_seed(8)
    emb, hid = (torch.randn(2, 5, 48, generator=g).to(DEV) for _ in range(2))
    pos = (torch.arange(5).repeat(2, 1) + 2).to(DEV)
    with torch.no_grad():
        ref = draft(emb, hid, pos)
        enable_fast_path(draft)
        for B in (1, 2):  # a [B, 5, H] slice of a [B, 9, H] buffer: contiguous only when B == 1
            buf = torch.full((B, 9, 48), 7.0, device=DEV)
            got = draft(emb[:B], hid[:B], pos[:B], out=buf[:, 2:7])
            assert got.data_ptr() == buf[:, 2:7].data_ptr()
            torch.testing.assert_close(buf[:, 2:7], ref[:B], atol=1e-5, rtol=1e-5)
            assert (buf[:, :2] == 7).all() and (buf[:, 7:] == 7).all()
        torch.testing.assert_close(draft(emb, hid, pos), ref, atol=1e-5, rtol=1e-5)  # no out: a fresh tensor


def test_add_rms_norm_writes_res_out():
    g = torch.Generator().manual_seed(9)
    x, r, w = torch.randn(3, 24, generator=g).to(DEV), torch.randn(3, 24, generator=g).to(DEV), torch.randn(24).to(DEV)
    dst = torch.empty(3, 24, device=DEV)
    normed, new_r = add_rms_norm_triton(x, r, w, 1e-6, res_out=dst)
    want_n, want_r = add_rms_norm_reference(x, r, w, 1e-6)
    assert new_r is dst and torch.equal(dst, want_r)
    close(normed, want_n, torch.float32)
    with pytest.raises(ValueError, match="res_out"):
        add_rms_norm_triton(x, None, w, 1e-6, res_out=dst)


def test_fused_ops_leave_training_on_the_reference():
    """With autograd on, a fused-ops model runs the eager reference: gradients reach every parameter. Under autocast
    (mixed dtypes) too, even without gradients."""
    draft = use_fused_ops(randomize(EagleDraft(tiny_config(num_hidden_layers=1))).train(), True)
    ids, pos = inputs()
    x = torch.randn(2, 7, 48)
    draft(x, x, pos).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = draft(x, x, pos)
        use_fused_ops(draft, False)
        assert torch.equal(fused, draft(x, x, pos))


# ---- engine ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("fused")
    target = write_tiny_llama(d / "t", vocab=17, hidden=32, heads=4, kv_heads=2, layers=2)
    return target, write_random_draft(d / "d", target, layers=1)


def test_runner_switches_to_the_fast_path_with_triton(pair):
    from eyas.engine.runner import ModelRunner
    from eyas.loader.eagle import load_draft
    from eyas.loader.resolve import load_target
    target, draft_dir = pair
    t, _ = load_target(str(target), "cpu", torch.float32)
    d = load_draft(draft_dir, t)
    ModelRunner(t, d, None, 8, 16, use_triton=False)
    assert not t.fused_ops and hasattr(t.model.layers[0].self_attn, "q_proj")
    ModelRunner(t, d, None, 8, 16, use_triton=True)
    for m, layers in ((t, t.model.layers), (d, d.layers)):
        assert m.fused_ops and hasattr(layers[0].self_attn, "qkv_proj") and hasattr(layers[0].mlp, "gate_up_proj")


def test_the_cpu_path_runs_without_triton(pair):
    """Triton is a test dependency only: with `import triton` failing, a CPU engine still prefills, drafts a tree,
    verifies and commits (a subprocess, so that this process's Triton stays)."""
    import subprocess
    import sys
    target, draft_dir = pair
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from eyas import LLM, SamplingParams\n"
        f"llm = LLM({str(target)!r}, device='cpu', dtype='float32', draft={str(draft_dir)!r}, speculation='tree:8')\n"
        "out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))\n"
        "assert [len(o.token_ids) for o in out] == [6, 6], out\n"
        "assert 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("spec", [None, "tree:8"])
def test_greedy_generation_with_the_fast_path_equals_reference(pair, spec):
    target, draft = pair
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [7]]
    # 4 tokens: tree:8's verify passes run at batch 3 (27 rows) twice, then at batch 2 (18) after a row finishes
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    kw = dict(device=DEV, dtype="float32", draft=str(draft) if spec else None, speculation=spec,
              max_model_len=SHORT_CONTEXT)
    ref_llm = LLM(str(target), **kw)
    ref_llm.engine.runner.use_triton = False
    for m in (ref_llm.target, ref_llm.draft):
        if m is not None:
            use_fused_ops(m, False)
    ref = [o.token_ids for o in ref_llm.generate(prompts, params)]
    llm = LLM(str(target), **kw)  # on CUDA the runner takes the fast path by itself; on the CPU switch it on
    for m in (llm.target, llm.draft):
        if m is not None:
            enable_fast_path(m)
    llm.engine.runner.use_triton = True  # Triton attention and KV writes too (interpreted on the CPU)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref


def test_greedy_generation_with_folded_norms_equals_reference(pair):
    """The folded forward (`fold_norms`) on every branch it has: prefill chunks (the norm kernel first), plain
    decoding at batch 3 (the norm in the RoPE + cache store; the one-row and few-rows kernels off, so every step takes
    `forward_folded`), and a verify pass of tree tokens (the norm in the RoPE + stash store). Tokens, and the verify
    pass's logits, stash and cache, equal the unfused reference's. (Engine runs of trees with folded norms:
    `test_greedy_generation_with_the_fast_path_equals_reference[tree:8]`, whose verify passes at batch 2 and 3, of
    18 and 27 rows, exceed the few-rows kernels' 16.)"""
    target, _ = pair
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [7]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(device=DEV, dtype="float32", max_model_len=SHORT_CONTEXT)
    ref_llm = LLM(str(target), **kw)
    ref_llm.engine.runner.use_triton = False
    use_fused_ops(ref_llm.target, False)
    ref = [o.token_ids for o in ref_llm.generate(prompts, params)]
    llm = LLM(str(target), **kw)
    enable_fast_path(llm.target, one_row=False, few_rows=False)
    assert llm.target.norms_folded
    llm.engine.runner.use_triton = True
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    # a prefill of 4 tokens, then a verify-shaped forward of 5 tree tokens (their K/V to a stash, the suffix under
    # an ancestor mask) through both models: the same cache, stash and logits
    from eyas.cache.kv_cache import KVCache
    from eyas.layers.attention import MetaBuilder, Stash
    from eyas.spec.drafter import causal_mask
    outs = []
    for lm, triton_on in ((ref_llm, False), (llm, True)):
        t, dev = lm.target, torch.device(DEV)
        cfg = t.config
        cache = KVCache.allocate(cfg, cfg.num_hidden_layers, 4, 16, torch.float32, dev)
        cache.k.zero_(), cache.v.zero_()
        meta = MetaBuilder(torch.tensor([[1, 2]], device=dev), 16, 0, triton_on)
        zero, ar = torch.zeros(1, dtype=torch.long, device=dev), torch.arange(4, device=dev)[None]
        pre = meta(zero, causal_mask(torch.tensor([4], device=dev), 4), slot_mapping=meta.slots(ar, ar >= 0))
        stash = Stash.like(cache, 1, 5)
        mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                            dtype=torch.bool, device=dev)[None]
        pos = 4 + torch.tensor([[0, 1, 1, 2, 2]], device=dev)
        with torch.no_grad():
            t(torch.tensor([[2, 7, 1, 8]], device=dev), ar, pre, cache)
            h = t(torch.tensor([[3, 1, 4, 1, 5]], device=dev), pos,
                  meta(torch.tensor([4], device=dev), mask, max_context_len=4, stash=stash), cache)
        outs.append((t.compute_logits(h), stash.k.clone(), stash.v.clone(), cache.k.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


# ---- GPU: compiled kernels, bf16, model-sized shapes ---------------------------------------------------------------
@gpu
@pytest.mark.parametrize("H,heads,kv_heads,D,I", [(576, 9, 3, 64, 1536), (4096, 32, 8, 128, 14336)])
@pytest.mark.parametrize("N", [1, 7, 64])
def test_gpu_bf16_kernels_match_reference(H, heads, kv_heads, D, I, N):
    g = torch.Generator(device="cuda").manual_seed(N)
    dt = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dt)

    x, r, w = rnd(N, H, scale=3), rnd(N, H), rnd(H, scale=0.2) + 1
    for res in (None, r):
        out, new_r = add_rms_norm_triton(x, res, w, 1e-5)
        ref_out, ref_r = add_rms_norm_reference(x, res, w, 1e-5)
        assert torch.equal(new_r, ref_r)  # the add is one rounding in both
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    rope = RotaryEmbedding(D, 8192, 500000.0, {"factor": 8.0, "original_max_position_embeddings": 8192}).cuda()
    pos = torch.randint(0, 8192, (N,), generator=g, device="cuda")
    qkv = rnd(N, (heads + 2 * kv_heads) * D, scale=2)
    q, k, _ = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q, k = q.view(N, heads, D), k.view(N, kv_heads, D)
    for a, b in zip(rope_triton(pos, q, k, rope.cos, rope.sin), rope_reference(pos, q, k, rope.cos, rope.sin)):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    gate, up = rnd(N, 2 * I, scale=3).chunk(2, dim=-1)
    torch.testing.assert_close(swiglu_triton(gate, up), swiglu_reference(gate, up), atol=2e-2, rtol=2e-2)
    # with a folded norm (the residual rows x scale gate and up; and q, k, v before the rotation and the store)
    torch.testing.assert_close(swiglu_triton(gate, up, norm_x=x, eps=1e-5),
                               swiglu_reference(gate, up, norm_x=x, eps=1e-5), atol=2e-2, rtol=2e-2)
    q, k, v = (t.view(1, N, -1, D) for t in qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1))
    got, want = [], []
    for fn, dst in ((rope_store_triton, got), (rope_store_reference, want)):
        kd, vd = (torch.zeros(N, kv_heads, D, device="cuda", dtype=dt) for _ in range(2))
        qo = fn(pos[None], q, k, v, rope.cos, rope.sin, kd, vd, seq_rows=N, norm_x=x[None], eps=1e-5)
        dst += [qo, kd, vd]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@gpu
def test_gpu_bf16_fused_model_matches_reference():
    """bf16: the fused path (unfolded) follows the eager reference's roundings closely; with the norms folded
    (`fold_norms`, other roundings) it is as close to the float32 model as the bf16 reference is."""
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=32, num_hidden_layers=4, vocab_size=1000)
    model32 = randomize(LlamaForCausalLM(cfg)).cuda()
    model = copy.deepcopy(model32).to(torch.bfloat16)
    ids, pos = inputs(B=3, Q=16, V=1000)
    ids, pos = ids.cuda(), pos.cuda()
    with torch.no_grad():
        truth = model32.compute_logits(model32(ids, pos))
        ref = model.compute_logits(model(ids, pos))
        out = model.compute_logits(enable_fast_path(model, fold=False)(ids, pos))
        folded = model.compute_logits(enable_fast_path(model)(ids, pos))
    assert model.norms_folded
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95
    err_ref, err_folded = (ref - truth).abs().mean(), (folded - truth).abs().mean()
    assert err_folded < 1.5 * err_ref, (err_folded, err_ref)
    agree = [(x.argmax(-1) == truth.argmax(-1)).float().mean() for x in (ref, folded)]
    assert agree[1] >= agree[0] - 0.05, agree
