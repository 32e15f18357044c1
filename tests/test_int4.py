"""INT4 drafts: the group quantization against its error bound, PyTorch's int4 kernels and eyas's Triton INT4 GEMV
against the dequantized reference (the CPU kernel and the interpreted Triton one here, the CUDA ones on the GPU), and
exactness through the engine: with an INT4 (or FP8) draft the output is still the target's own (non-speculative
decoding is the oracle)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas import LLM, SamplingParams
from eyas.layers.linear_int4 import Int4Linear, dequantize_int4, pick_group_size, quantize_int4
from eyas.spec.draft_quant import quantize_draft
from eyas.spec.draft_vocab import attach_draft_vocab, draft_full_logits, draft_topk
from helpers import interpreted_only, load_mirror_pair, write_mirror_pair


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), groups=st.integers(1, 4), g=st.sampled_from([32, 64]), seed=st.integers(0, 2**16),
       spread=st.floats(1e-3, 1e3))
def test_quantize_int4_error_bound(n, groups, g, seed, spread):
    w = torch.randn(n, groups * g, generator=torch.Generator().manual_seed(seed)) * spread
    q, sz = quantize_int4(w, g)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and sz.shape == (groups, n, 2)
    scale = sz[..., 0].t().repeat_interleave(g, dim=1)  # [n, K]
    err = (dequantize_int4(q, sz, g) - w).abs()
    assert (err <= scale / 2 * (1 + 1e-4) + 1e-6 * spread).all()
    # each group's extremes are codes 0 and 15, so they come back (to rounding)
    wg = w.reshape(n, groups, g)
    d = dequantize_int4(q, sz, g).reshape(n, groups, g)
    torch.testing.assert_close(d.amin(-1), wg.amin(-1), rtol=1e-5, atol=1e-6 * spread)
    torch.testing.assert_close(d.amax(-1), wg.amax(-1), rtol=1e-5, atol=1e-6 * spread)


def test_quantize_int4_exact_on_its_grid_and_for_constant_groups():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 64), generator=g)
    codes[:, 0], codes[:, 1] = 0, 15  # every group spans the whole code range
    codes[:, 32], codes[:, 33] = 0, 15
    scale, lo = torch.rand(16, 2, 1, generator=g) + 0.1, torch.randn(16, 2, 1, generator=g)
    w = (codes.reshape(16, 2, 32) * scale + lo).reshape(16, 64)
    q, sz = quantize_int4(w, 32)
    assert torch.equal(q.long(), codes)
    torch.testing.assert_close(dequantize_int4(q, sz, 32), w)
    const = torch.full((8, 32), 0.37)
    q, sz = quantize_int4(const, 32)
    torch.testing.assert_close(dequantize_int4(q, sz, 32), const)


def test_pick_group_size_and_bad_shapes():
    assert pick_group_size(576) == 64  # SmolLM2's hidden size: 9 x 64
    assert pick_group_size(1536) == 128 and pick_group_size(4096, 256) == 256 and pick_group_size(96, 128) == 32
    with pytest.raises(ValueError, match="multiple of 32"):
        pick_group_size(100)
    with pytest.raises(ValueError, match="group size must be one of"):
        pick_group_size(4096, 100)
    with pytest.raises(ValueError, match="2-D weight"):
        quantize_int4(torch.zeros(4), 32)
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        quantize_int4(torch.zeros(4, 48), 32)


@pytest.mark.parametrize("n,k,bias", [(48, 96, False), (64, 256, True), (3072, 576, False), (576, 1536, True),
                                      (40, 576, False)])
def test_int4_linear_cpu_kernel_equals_reference(n, k, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=bias)
    m = Int4Linear.from_linear(lin)
    x = torch.randn(2, 5, k)
    assert m.kernel_ok(x) == (n % 16 == 0)  # (40, 576): the CPU kernel needs N % 16 == 0, the reference runs
    got = m(x)
    m.use_kernel = False
    ref = m(x)
    assert got.shape == ref.shape == (2, 5, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    # the reference is F.linear on the dequantized weight
    w = dequantize_int4(m.codes(), m.scales_and_zeros, m.group_size)
    torch.testing.assert_close(ref, torch.nn.functional.linear(x, w, lin.bias), rtol=1e-5, atol=1e-5)
    # and the dequantized weight is the original within half a step of its group
    assert (w - lin.weight).abs().max() <= m.scales_and_zeros[..., 0].max() / 2 + 1e-6
    m.use_kernel = True
    xb = x.bfloat16()
    torch.testing.assert_close(m(xb).float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


@pytest.fixture(scope="module")
def mirror_pair(tmp_path_factory):
    return write_mirror_pair(tmp_path_factory.mktemp("mirror_int4"), vocab=24, layers=2)


def test_quantize_draft_modes_and_errors(mirror_pair):
    target, draft = load_mirror_pair(mirror_pair)
    h = torch.randn(2, 3, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert quantize_draft(draft, target, None) is draft and getattr(draft, "quant", None) is None
    quantize_draft(draft, target, "int4-ffn")
    for layer in draft.layers:
        assert isinstance(layer.mlp.gate_up_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)
    assert getattr(draft, "head_quant", None) is None
    with pytest.raises(ValueError, match="quantized already"):
        quantize_draft(draft, target, "int4-head")
    target, draft = load_mirror_pair(mirror_pair)
    quantize_draft(draft, target, "int4-head")
    assert isinstance(draft.layers[0].mlp.down_proj, torch.nn.Linear)
    # the draft scores with its INT4 copy of the head; the target keeps its own
    w = draft.head_quant.dequantized()
    torch.testing.assert_close(draft_full_logits(draft, target, h), h @ w.t())
    assert torch.equal(draft_topk(draft, target, h, 3), (h @ w.t()).topk(3, dim=-1).indices)
    assert target.lm_head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="attach the draft vocabulary before quantizing"):
        attach_draft_vocab(draft, target, torch.arange(8))
    # with a draft vocabulary, the INT4 head holds its rows only and maps back to target ids
    target, draft = load_mirror_pair(mirror_pair)
    ids = torch.tensor([1, 4, 5, 8, 11, 13, 20, 23])
    attach_draft_vocab(draft, target, ids)
    quantize_draft(draft, target, "int4")
    assert draft.head_quant.out_features == 8
    got = draft_topk(draft, target, h, 2)
    assert torch.equal(got, ids[(h @ draft.head_quant.dequantized().t()).topk(2, dim=-1).indices])
    with pytest.raises(ValueError, match="must be one of"):
        quantize_draft(draft, target, "int3")
    with pytest.raises(ValueError, match="needs a draft"):
        LLM(str(mirror_pair[0]), device="cpu", dtype="float32", draft_quant="int4")


@pytest.mark.parametrize("quant", ["int4", "fp8"])
@pytest.mark.parametrize("spec", ["chain:3", "tree:8"])
def test_engine_stays_exact_with_a_quantized_draft(mirror_pair, spec, quant):
    target, draft = mirror_pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 24, (n,), generator=g).tolist() for n in (1, 9, 16)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(target), device="cpu", dtype="float32").generate(prompts, params)]
    full = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec).generate(prompts, params)
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec, draft_quant=quant)
    assert llm.draft.quant == quant
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in full] == ref
    # the mirror draft stays a good one in 4 or 8 bits: most of its guesses are still accepted
    tpc = sum(o.stats.committed for o in outs) / sum(o.stats.target_calls for o in outs)
    tpc_full = sum(o.stats.committed for o in full) / sum(o.stats.target_calls for o in full)
    assert tpc > 1.5 and tpc > 0.8 * tpc_full


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(1024, 4096), (8192, 4096), (4096, 14336), (3072, 576), (49152, 576)])
def test_int4_linear_gpu_kernel_equals_reference(n, k):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    m = Int4Linear.from_linear(lin)
    for rows in (1, 4, 16):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        assert m.kernel_ok(x)
        got = m(x).float()
        ref = x.float() @ m.dequantized().t()
        torch.testing.assert_close(got, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
        from eyas.kernels.gemv_int4 import gemv_int4_triton  # the Triton candidate, compiled for the GPU
        tri = gemv_int4_triton(x, m.qweight, m.scales_and_zeros, m.group_size).float()
        torch.testing.assert_close(tri, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
        m.cuda_kernel = "triton"  # Int4Linear's own switch to it (its own launch config: equal to the reference,
        got_tri = m(x).float()     # not bit-equal to the call above)
        torch.testing.assert_close(got_tri, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
        assert not torch.equal(got_tri, got)  # the switch reached the Triton kernel, not tinygemm
        m.cuda_kernel = "torch"


@pytest.mark.parametrize("m,n,k,g,split", [(1, 40, 256, 64, None), (3, 32, 512, 128, 4), (16, 8, 96, 32, 1),
                                           (2, 24, 128, 32, 2)])
@interpreted_only
def test_gemv_int4_triton_equals_reference_interpreted(m, n, k, g, split):
    """The Triton INT4 GEMV (eyas/kernels/gemv_int4.py) under TRITON_INTERPRET=1, float32 and bf16 activations."""
    from eyas.kernels.gemv_int4 import gemv_int4_reference, gemv_int4_triton
    torch.manual_seed(0)
    m4 = Int4Linear(torch.randn(n, k), None, g)
    assert m4.group_size == g
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(m, k).to(dtype)
        got = gemv_int4_triton(x, m4.qweight, m4.scales_and_zeros, g, split_k=split)
        ref = gemv_int4_reference(x, m4.qweight, m4.scales_and_zeros, g)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())
    # and the reference is Int4Linear's own (dequantise, then F.linear)
    m4.use_kernel = False
    x = torch.randn(m, k)
    torch.testing.assert_close(gemv_int4_reference(x, m4.qweight, m4.scales_and_zeros, g), m4(x))


def test_gemv_int4_triton_refuses_bad_input():
    from eyas.kernels.gemv_int4 import gemv_int4_triton
    m4 = Int4Linear(torch.randn(16, 64), None, 32)
    with pytest.raises(ValueError, match="1 <= M <= 16"):
        gemv_int4_triton(torch.randn(17, 64), m4.qweight, m4.scales_and_zeros, 32)
    with pytest.raises(ValueError, match="a power of two dividing K"):
        gemv_int4_triton(torch.randn(2, 62), m4.qweight, m4.scales_and_zeros, 32)
    with pytest.raises(ValueError, match="scales_and_zeros must be contiguous"):
        gemv_int4_triton(torch.randn(2, 64), m4.qweight, m4.scales_and_zeros[:1], 32)


@pytest.mark.parametrize("m,n,k", [(1, 128256, 4096), (4, 4096, 14336), (16, 28672, 4096)])
def test_gemv_int4_compiles_for_sm90_without_a_gpu(m, n, k):
    """The interpreter accepts kernels that ptxas rejects: compile the Triton INT4 GEMV for sm_90 (the H200) with the
    ptxas inside the triton wheel, at the default configs of the 8B draft's shapes, and check it does not spill."""
    import triton
    try:
        import triton.backends.compiler  # noqa: F401
        import triton.compiler  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton has no offline compiler API: {e}")
    from eyas.kernels.gemv_int4 import default_int4_config
    from helpers import compile_for_sm90
    sig = {"X": "*bf16", "QW": "*u8", "SZ": "*bf16", "OUT": "*bf16", "WS": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "GROUPS_PER_SPLIT": "i32", "stride_xm": "i32", "stride_qn": "i32", "stride_om": "i32",
           "M_PAD": "constexpr", "BLOCK_N": "constexpr", "GROUP": "constexpr", "SPLIT": "constexpr"}
    block_n, split = default_int4_config(m, n, k, 128)
    constexprs = {"M_PAD": triton.next_power_of_2(m), "BLOCK_N": block_n, "GROUP": 128, "SPLIT": split > 1}
    (result,) = compile_for_sm90([("eyas.kernels.gemv_int4", "_gemv_int4_kernel", sig, constexprs,
                                   {"num_warps": 4, "num_stages": 3})])
    assert result["error"] is None, result["error"]
    if result["usage"] is None:
        pytest.skip("no cuobjdump in the triton wheel: compiled, spills not checked")
    assert "REG:" in result["usage"] and "LOCAL:0" in result["usage"], result["usage"]  # no spills to local memory
