"""FP8 drafts: the per-row e4m3 quantization against its error bound, the Triton GEMV's FP8 path against the
dequantised reference (interpreted here, compiled on the GPU), and `quantize_draft(..., "fp8")`. Exactness through
the engine with an FP8 draft (non-speculative decoding as the oracle) is tests/test_int4.py's
`test_engine_stays_exact_with_a_quantized_draft`, for both kinds."""
import os

import torch

if not torch.cuda.is_available():  # before triton is first imported (as tests/test_gemv.py)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eyas.kernels.gemv import GemvConfig, default_config, gemv_reference, gemv_triton  # noqa: E402
from eyas.layers.linear_fp8 import FP8_MAX, Fp8Linear, dequantize_fp8, quantize_fp8  # noqa: E402
from eyas.spec.draft_quant import quantize_draft  # noqa: E402
from eyas.spec.draft_vocab import attach_draft_vocab, draft_full_logits, draft_topk  # noqa: E402
from helpers import load_mirror_pair, write_mirror_pair  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), k=st.integers(1, 80), seed=st.integers(0, 2**16), spread=st.floats(1e-3, 1e3))
def test_quantize_fp8_error_bound(n, k, seed, spread):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * spread
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (n,) and scale.dtype == torch.float32
    assert (q.float().abs().amax(1) == FP8_MAX).all()  # every row's largest weight is the largest code
    d = dequantize_fp8(q, scale)
    # e4m3: 3 mantissa bits, so a normal code is within 2^-4 of its value; below 2^-6 the step is 2^-9 (subnormals)
    bound = torch.maximum(w.abs() * 2 ** -4, scale[:, None] * 2 ** -10)
    assert ((d - w).abs() <= bound * (1 + 1e-5)).all()
    torch.testing.assert_close(d.abs().amax(1), w.abs().amax(1), rtol=1e-6, atol=0)


def test_quantize_fp8_zero_rows_and_errors():
    w = torch.zeros(3, 8)
    w[1] = torch.arange(8) - 3.5
    q, scale = quantize_fp8(w)
    assert scale[0] == 1 and scale[2] == 1 and (q[0].float() == 0).all()
    torch.testing.assert_close(dequantize_fp8(q, scale)[1], w[1])  # halves and small integers are codes
    with pytest.raises(ValueError, match="2-D weight"):
        quantize_fp8(torch.randn(4))


# the FP8 path of the GEMV, small configs for the interpreter (as tests/test_gemv.py): both paths, splits
CONFIGS = {"default": None, "ew": GemvConfig(BLOCK_N=16, BLOCK_K=32), "ew_split3": GemvConfig(8, 64, SPLIT_K=3),
           "dot_split2": GemvConfig(BLOCK_N=32, BLOCK_K=16, SPLIT_K=2, use_dot=True),
           "half_split2": GemvConfig(BLOCK_N=8, BLOCK_K=32, SPLIT_K=2, half_acc=True)}


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("M,N,K,bias", [(1, 37, 100, False), (3, 64, 576, True), (16, 5, 64, False)])
def test_gemv_fp8_equals_reference(M, N, K, bias, cfg):
    g = torch.Generator().manual_seed(M * N + K)
    q, scale = quantize_fp8(torch.randn(N, K, generator=g) / K ** 0.5)
    b = torch.randn(N, generator=g) if bias else None
    half = cfg.startswith("half") or (cfg == "default" and M <= 2)  # float16 products and sums (the default at
    # one or two rows): within a few float16 roundings
    for dtype, tol in ((torch.float32, 2e-3 if half else 1e-5), (torch.bfloat16, 2 ** -7)):
        x = torch.randn(M, K, generator=g).to(dtype)
        bd = None if b is None else b.to(dtype).to(DEV)
        got = gemv_triton(x.to(DEV), q.to(DEV), bd, config=CONFIGS[cfg], scale=scale.to(DEV))
        ref = gemv_reference(x, q, None if b is None else b.to(dtype), scale=scale)
        assert got.dtype == dtype and got.shape == (M, N)
        torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol, atol=2e-3 if half else 1e-5)
    # the reference is F.linear over the dequantised weight
    x = torch.randn(M, K, generator=g)
    torch.testing.assert_close(gemv_reference(x, q, b, scale=scale),
                               torch.nn.functional.linear(x, dequantize_fp8(q, scale), b))


def test_gemv_fp8_refuses_bad_input():
    q, scale = quantize_fp8(torch.randn(8, 32))
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn weights"):
        gemv_triton(x, torch.randn(8, 32), scale=scale)
    with pytest.raises(ValueError, match="scale must be float32"):
        gemv_triton(x, q, scale=scale[:4])
    with pytest.raises(ValueError, match="scale must be float32"):
        gemv_triton(x, q, scale=scale.double())
    with pytest.raises(ValueError, match="FP8 weights with a scale"):
        gemv_triton(x, q)  # codes without their scale
    with pytest.raises(ValueError, match="half_acc is for the elementwise path"):
        GemvConfig(BLOCK_N=16, BLOCK_K=16, use_dot=True, half_acc=True)
    # the H200 sweeps' best configs of the 8B draft's shapes: float16 sums on the CUDA cores at one or two rows, the
    # tensor cores above
    fp8 = torch.float8_e4m3fn
    assert default_config(1, 4096, 8192, torch.bfloat16, weight_dtype=fp8) == GemvConfig(8, 1024, 1, 4, 4,
                                                                                         half_acc=True)
    assert default_config(4, 4096, 8192, torch.bfloat16, weight_dtype=fp8) == GemvConfig(128, 128, 4, 4, 4, True)
    assert default_config(4, 28672, 4096, torch.bfloat16, weight_dtype=fp8) == GemvConfig(128, 128, 1, 8, 3, True)


def test_fp8_linear_cpu_is_the_reference():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40, bias=True)
    m = Fp8Linear.from_linear(lin)
    x = torch.randn(2, 5, 96)
    assert not m.kernel_ok(x.reshape(-1, 96))  # the CPU runs the reference
    y = m(x)
    assert y.shape == (2, 5, 40)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, m.dequantized(), lin.bias))
    # and the FP8 weight is the original within e4m3's rounding
    assert ((m.dequantized() - lin.weight).abs() <= lin.weight.abs() * 2 ** -4 + m.scale[:, None] * 2 ** -10).all()


@pytest.fixture
def kernel_calls(monkeypatch):
    """The names of the FP8 kernels Fp8Linear launches ("decode_linear": the register kernel; "gemv_triton": the
    GEMV), in order; on the CPU the kernels are forced (interpreted) where the reference would run."""
    import eyas.kernels.decode_linear as dl
    import eyas.kernels.gemv as gv
    if DEV == "cpu":
        monkeypatch.setattr(Fp8Linear, "kernel_ok", lambda self, x2: True)
    calls = []
    for mod, name in ((dl, "decode_linear"), (gv, "gemv_triton")):
        f = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=f, _n=name, **k: calls.append(_n) or _f(*a, **k))
    return calls


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_kernels_by_rows(kernel_calls, bias):
    """Where the kernels run (on the CPU forced, interpreted): one or two rows without bias on decode_linear's
    register kernel, more (or a bias) on the FP8 GEMV; all equal to the reference."""
    calls = kernel_calls
    torch.manual_seed(1)
    m = Fp8Linear.from_linear(torch.nn.Linear(96, 40, bias=bias)).to(DEV)
    for rows in (1, 2, 3):
        calls.clear()
        x = torch.randn(rows, 96, device=DEV)
        ref = torch.nn.functional.linear(x, m.dequantized(), m.bias)
        tol = 1e-5 if rows <= 2 and not bias else 2e-3  # the GEMV's default at <= 2 rows sums in float16
        torch.testing.assert_close(m(x), ref, atol=tol, rtol=tol)
        assert calls == ["decode_linear" if rows <= 2 and not bias else "gemv_triton"]


def test_wide_fp8_linear_takes_the_register_kernel_at_one_row_only(kernel_calls):
    """A wide model's linear (both dimensions over WIDE_DIM: an 8B draft's, 4096-32768) takes the register kernel at
    one row only; two rows go to the FP8 GEMV (on the H200 the register kernel took them ~3x as long as one, session
    44). Both equal to the reference (on the CPU forced, interpreted). A linear with one side of a narrow model's
    width (SmolLM2's fc, 576 x 1152, and down, 576 x 1536) keeps two rows."""
    import eyas.layers.linear_fp8 as lf
    calls = kernel_calls
    torch.manual_seed(2)
    K = lf.WIDE_DIM + 64
    m = Fp8Linear.from_linear(torch.nn.Linear(K, K + 8, bias=False)).to(DEV)
    assert m.row_kernel_max_rows() == lf.WIDE_ROW_KERNEL_MAX_ROWS == 1
    for k, n in ((lf.WIDE_DIM, K), (K, lf.WIDE_DIM), (1152, 576), (1536, 576)):
        assert Fp8Linear.from_linear(torch.nn.Linear(k, n, bias=False)).row_kernel_max_rows() == 2
    for rows, want in ((1, "decode_linear"), (2, "gemv_triton")):
        calls.clear()
        x = torch.randn(rows, K, device=DEV)
        ref = torch.nn.functional.linear(x, m.dequantized())
        tol = 1e-5 if rows == 1 else 4e-3  # the GEMV's default at <= 2 rows sums in float16
        torch.testing.assert_close(m(x), ref, atol=tol, rtol=tol)
        assert calls == [want]


@pytest.fixture(scope="module")
def mirror_pair(tmp_path_factory):
    return write_mirror_pair(tmp_path_factory.mktemp("mirror_fp8"), vocab=24, layers=2)


def test_quantize_draft_fp8(mirror_pair):
    target, draft = load_mirror_pair(mirror_pair)
    ids = torch.tensor([1, 4, 5, 8, 11, 13, 20, 23])
    attach_draft_vocab(draft, target, ids)
    quantize_draft(draft, target, "fp8")
    assert draft.quant == "fp8" and isinstance(draft.fc, Fp8Linear)
    for layer in draft.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(m, Fp8Linear)
        assert not any(isinstance(c, torch.nn.Linear) for c in layer.modules())
    # the draft scores with its FP8 copy of its vocabulary's rows and maps back to target ids; the target keeps its
    # own head
    assert draft.head_quant.out_features == 8 and target.lm_head.weight.dtype == torch.float32
    h = torch.randn(2, 3, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    w = draft.head_quant.dequantized()
    assert torch.equal(draft_topk(draft, target, h, 2), ids[(h @ w.t()).topk(2, dim=-1).indices])
    full = draft_full_logits(draft, target, h)
    torch.testing.assert_close(full[..., ids], h @ w.t())
    assert torch.isinf(full[..., [0, 2, 3]]).all()
    with pytest.raises(ValueError, match="quantized already"):
        quantize_draft(draft, target, "fp8")


def test_quantize_draft_fp8_head_only(mirror_pair):
    """`fp8-head`: the draft's layers stay as they are (bf16 here float32 nn.Linear), only its head's copy is FP8
    (of the draft vocabulary's rows), and the draft scores its candidates with it."""
    target, draft = load_mirror_pair(mirror_pair)
    ids = torch.tensor([1, 4, 5, 8, 11, 13, 20, 23])
    attach_draft_vocab(draft, target, ids)
    fc = draft.fc.weight.clone()
    quantize_draft(draft, target, "fp8-head")
    assert draft.quant == "fp8-head" and isinstance(draft.fc, torch.nn.Linear) and torch.equal(draft.fc.weight, fc)
    assert not any(isinstance(m, Fp8Linear) for m in draft.layers.modules())
    assert isinstance(draft.head_quant, Fp8Linear) and draft.head_quant.out_features == 8
    h = torch.randn(2, 3, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    w = draft.head_quant.dequantized()
    assert torch.equal(draft_topk(draft, target, h, 2), ids[(h @ w.t()).topk(2, dim=-1).indices])


def test_the_draft_chooses_its_default_quantization(tmp_path, monkeypatch):
    """Without a draft_quant, a draft's config.json `eyas_draft_quant` picks the quantization for the device type;
    "none" turns it off, an explicit mode wins, the choice survives a save and reload, FP8 is not chosen on a GPU
    without it (before sm_89), and the shipped SmolLM2 draft asks fp8-head on the GPU and nothing on the CPU. The
    output stays non-speculative decoding's."""
    import json
    import shutil
    from pathlib import Path

    from eyas import LLM, SamplingParams
    from eyas.config import ModelConfig
    from eyas.spec.draft_quant import asks_quant, check_quant_mode, resolve_draft_quant
    target, draft = write_mirror_pair(tmp_path, vocab=24, layers=2)
    cfg = json.loads((draft / "config.json").read_text())
    assert "eyas_draft_quant" not in cfg
    kw = dict(device="cpu", dtype="float32", speculation="tree:8")
    assert getattr(LLM(str(target), draft=str(draft), **kw).draft, "quant", None) is None  # no choice: none
    chosen = tmp_path / "chosen"
    shutil.copytree(draft, chosen)
    cfg["eyas_draft_quant"] = {"cpu": "fp8-head", "cuda": "int4-head"}
    (chosen / "config.json").write_text(json.dumps(cfg))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(target), device="cpu", dtype="float32").generate(prompts, params)]
    llm = LLM(str(target), draft=str(chosen), **kw)
    assert llm.draft.quant == "fp8-head" and isinstance(llm.draft.head_quant, Fp8Linear)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert ModelConfig.from_hf(llm.draft.config.to_hf()).draft_quant == cfg["eyas_draft_quant"]
    assert getattr(LLM(str(target), draft=str(chosen), draft_quant="none", **kw).draft, "quant", None) is None
    assert LLM(str(target), draft=str(chosen), draft_quant="int4-head", **kw).draft.quant == "int4-head"
    assert resolve_draft_quant(llm.draft, None, "cuda") == "int4-head"  # (no GPU needed: not an FP8 mode)
    assert not asks_quant(None) and not asks_quant("none") and asks_quant("fp8-head")
    with pytest.raises(ValueError, match="must be one of"):
        check_quant_mode("fp4")
    LLM(str(target), draft_quant="none", device="cpu", dtype="float32")  # "none" needs no draft
    with pytest.raises(ValueError, match="needs a draft"):
        LLM(str(target), draft_quant="fp8-head", device="cpu", dtype="float32")
    shipped = type("D", (), {"config": ModelConfig.from_hf(json.loads(
        (Path(__file__).parents[1] / "eyas/drafts/smollm2/config.json").read_text()))})
    assert resolve_draft_quant(shipped, None, "cpu") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_draft_quant(shipped, None, "cuda") == "fp8-head"
    assert resolve_draft_quant(shipped, "none", "cuda") is None
    from eyas.bench.shapes import SHAPES  # the benchmarks' random SmolLM2-shaped draft asks what the shipped one does
    shape = type("D", (), {"config": SHAPES["smollm2-shape"]})
    assert resolve_draft_quant(shape, None, "cuda") == "fp8-head"
    assert resolve_draft_quant(type("D", (), {"config": SHAPES["llama-3.1-8b-shape"]}), None, "cuda") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100: no FP8
    assert resolve_draft_quant(shipped, None, "cuda") is None
    assert resolve_draft_quant(shipped, "fp8-head", "cuda") == "fp8-head"  # asked: as asked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_engine_exact_with_fp8_draft_levels_on_rows(mirror_pair, graphs):
    """On a GPU an FP8 draft's tree levels take the register kernel (`forward_draft_rows` with the codes' scales,
    levels of up to 8 tokens for a small draft) and its head the same kernel at one or two rows: greedy output equals
    non-speculative decoding, with and without CUDA graphs, chain and tree."""
    from eyas import LLM, SamplingParams
    target, draft = mirror_pair
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 24, (n,), generator=g).tolist() for n in (1, 9, 16)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", cuda_graphs=graphs)
    ref = [o.token_ids for o in LLM(str(target), **kw).generate(prompts, params)]
    for spec, quant in (("chain:3", "fp8"), ("tree:8", "fp8"), ("tree:8", "fp8-head")):
        llm = LLM(str(target), draft=str(draft), speculation=spec, draft_quant=quant, **kw)
        if quant == "fp8":
            assert llm.draft.few_rows and llm.draft.few_rows_max == 8
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == ref, (spec, quant)
        assert sum(o.stats.committed for o in outs) > 1.5 * sum(o.stats.target_calls for o in outs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(4096, 8192), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (32768, 4096), (3072, 576)])
def test_fp8_linear_gpu_kernel_equals_reference(n, k):
    """The compiled FP8 GEMV on the 8B draft's shapes (fc, qkv, o, gate_up, down, a 32k head) and SmolLM2's."""
    torch.manual_seed(0)
    m = Fp8Linear.from_linear(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    for rows in (1, 4, 16, 17):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        assert m.kernel_ok(x) == (rows <= 16)
        got = m(x).float()
        ref = x.float() @ m.dequantized().t()
        torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=2e-3 * ref.abs().max().item())
