"""The decode linears (eyas.kernels.decode_linear) against their plain-PyTorch reference, and the one-row decode
step (eyas.models.one_row) against the fused path it replaces.

Without CUDA the kernel runs under the Triton interpreter (CPU), without PDL. On a GPU machine the `gpu` tests run
the compiled kernel with PDL on the 8B and SmolLM2 shapes, and a tiny model's greedy decoding with the one-row path
against the fused path:

    .venv/bin/python -m pytest -q tests/test_decode_linear.py
"""
import os

import torch

if not torch.cuda.is_available():  # before Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

import pytest  # noqa: E402

import eyas.kernels.decode_linear as dl  # noqa: E402
from eyas import LLM, SamplingParams  # noqa: E402
from eyas.kernels.decode_linear import (DecodeLinearConfig, TileConfig, decode_linear,  # noqa: E402
                                        decode_linear_reference, decode_qkv_rope, decode_qkv_rope_reference,
                                        default_decode_config, default_tile_config, k_parts)
from eyas.layers.rotary import RotaryEmbedding  # noqa: E402
from eyas.models.fused import enable_fast_path  # noqa: E402
from helpers import SHORT_CONTEXT, write_random_draft, write_tiny_llama  # noqa: E402

DEV = "cpu" if INTERPRET else "cuda"
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                         reason="needs CUDA and compiled (not interpreted) Triton kernels")


def _inputs(N, K, dtype, device, seed=0, M=1):
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    return rnd(M, K, scale=2), rnd(N, K, scale=K ** -0.5), rnd(K, scale=0.2) + 1, rnd(M, N)


def _kind_kwargs(kind: str, g, r) -> dict:
    """decode_linear's prologue / epilogue arguments for a test case's `kind` ("norm", "residual", "swiglu", joined
    by "+"), from its norm weight g and residual r."""
    kw = {}
    if "norm" in kind:
        kw["norm_weight"] = g
    if "residual" in kind:
        kw["residual"] = r
    if "swiglu" in kind:
        kw["swiglu"] = True
    return kw


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # a few bf16 steps: the interpreter rounds by truncation, the float32 sums run in another order, and
        # SwiGLU multiplies two rounded values
        torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K,block_n", [(24, 64, 4), (13, 48, 4), (10, 100, 2), (6, 40, 16), (9, 90, 4)])
@pytest.mark.parametrize("kind", ["plain", "norm", "residual", "norm+swiglu", "norm+residual"])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_decode_linear_matches_reference(dtype, N, K, block_n, kind, M):
    """Every prologue/epilogue, 1 to 8 rows, K not a power of two (48 and 40 held as two exact parts, 90 as 64 +
    a masked 32, 100 as one padded part), N not a multiple of the rows per program (the tail program)."""
    if "swiglu" in kind:
        N *= 2  # N gate rows and N up rows: N not a multiple of the pairs per program
    x, w, g, r = _inputs(N, K, dtype, DEV, seed=N * K + M, M=M)
    kw = _kind_kwargs(kind, g, r)
    cfg = DecodeLinearConfig(BLOCK_N=block_n, num_warps=2)
    _check(decode_linear(x, w, config=cfg, **kw), decode_linear_reference(x, w, **kw), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K,block_n,block_k", [(40, 100, 16, 32), (24, 64, 32, 16), (13, 48, 16, 64)])
@pytest.mark.parametrize("kind", ["plain", "norm", "residual", "norm+swiglu"])
@pytest.mark.parametrize("M", [2, 5, 17, 49])
def test_tile_linear_matches_reference(dtype, N, K, block_n, block_k, kind, M):
    """The tile kernel (2 to 64 rows, x padded to 16, 32 or 64): every prologue/epilogue, several K tiles with a
    ragged last one, N not a multiple of the rows per program."""
    if "swiglu" in kind:
        N *= 2
    x, w, g, r = _inputs(N, K, dtype, DEV, seed=N * K + M, M=M)
    kw = _kind_kwargs(kind, g, r)
    cfg = TileConfig(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=2, num_stages=2)
    _check(decode_linear(x, w, config=cfg, **kw), decode_linear_reference(x, w, **kw), dtype)


@pytest.mark.parametrize("kind", ["plain", "norm", "residual", "norm+swiglu"])
@pytest.mark.parametrize("M", [17, 49])
def test_tile_linear_blocks_of_rows(kind, M):
    """`TileConfig.BLOCK_M`: the rows split over a second grid dimension (the last block ragged), every prologue
    and epilogue, in float32 (each block's rows are its own: a block that read another's rows, or stored them,
    fails)."""
    N, K = (80, 100) if "swiglu" in kind else (40, 100)
    x, w, g, r = _inputs(N, K, torch.float32, DEV, seed=N * K + M, M=M)
    kw = _kind_kwargs(kind, g, r)
    cfg = TileConfig(BLOCK_N=16, BLOCK_K=32, num_warps=2, num_stages=2, BLOCK_M=16)
    _check(decode_linear(x, w, config=cfg, **kw), decode_linear_reference(x, w, **kw), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["plain", "norm", "residual", "norm+swiglu"])
@pytest.mark.parametrize("M,K,block_m", [(5, 100, 0), (17, 40, 16), (49, 72, 16), (33, 10, 32)])
@pytest.mark.parametrize("joined", [True, False])
def test_tile_whole_k_matches_reference(monkeypatch, dtype, kind, M, K, block_m, joined):
    """`TileConfig.BLOCK_K = 0`: the whole row of K in one step (two parts when K is not a power of two: 40 = 32 +
    16 (8 padded to 16), 72 = 64 + 16; 100 and 10 in one padded part), every prologue and epilogue, with and
    without blocks of rows; SwiGLU's pairs as one interleaved tile (`JOINED_PAIRS`) or two."""
    import eyas.kernels.decode_linear as dl
    if not joined and "swiglu" not in kind:
        pytest.skip("JOINED_PAIRS changes pairs only")
    monkeypatch.setattr(dl, "JOINED_PAIRS", joined)
    N = 80 if "swiglu" in kind else 40
    x, w, g, r = _inputs(N, K, dtype, DEV, seed=N * K + M, M=M)
    kw = _kind_kwargs(kind, g, r)
    cfg = TileConfig(BLOCK_N=32 if "swiglu" in kind else 16, BLOCK_K=0, num_warps=2, num_stages=1, BLOCK_M=block_m)
    _check(decode_linear(x, w, config=cfg, **kw), decode_linear_reference(x, w, **kw), dtype)


@pytest.mark.parametrize("kind", ["plain", "norm", "residual", "norm+swiglu"])
@pytest.mark.parametrize("M,K,block_m", [(5, 100, 0), (17, 40, 16), (49, 72, 32)])
def test_tile_first_w_matches_reference(kind, M, K, block_m):
    """`TileConfig.first_w`: the K loop's first weight tile loaded before the wait and taken in its first step
    (several steps, a ragged last one), every prologue and epilogue, with and without blocks of rows."""
    N = 80 if "swiglu" in kind else 40
    x, w, g, r = _inputs(N, K, torch.float32, DEV, seed=N * K + M, M=M)
    kw = _kind_kwargs(kind, g, r)
    cfg = TileConfig(BLOCK_N=32 if "swiglu" in kind else 16, BLOCK_K=16, num_warps=2, num_stages=2, BLOCK_M=block_m,
                     first_w=True)
    _check(decode_linear(x, w, config=cfg, **kw), decode_linear_reference(x, w, **kw), torch.float32)


@pytest.mark.parametrize("kind,N", [("norm", 40), ("residual", 24), ("norm+swiglu", 80), ("norm+swiglu", 2100)])
def test_wide_whole_k_defaults(monkeypatch, kind, N):
    """`WHOLE_K_ROWS` above 16 (the default since session 38): 49 rows on the whole-K tile's configs for launches
    of more than 16 rows (pairs: 64-row tiles from 1024 pairs, 32-row ones below), against the reference."""
    import eyas.kernels.decode_linear as dl
    monkeypatch.setattr(dl, "WHOLE_K_ROWS", 64)
    x, w, g, r = _inputs(N, 24, torch.float32, DEV, seed=N, M=49)
    kw = _kind_kwargs(kind, g, r)
    cfg = dl.default_tile_config(49, N // 2 if "swiglu" in kind else N, 24, pairs="swiglu" in kind)
    assert cfg.BLOCK_K == 0 and cfg.BLOCK_N == (64 if N > 2048 else 32 if "swiglu" in kind else 16)
    _check(decode_linear(x, w, **kw), decode_linear_reference(x, w, **kw), torch.float32)


def test_k_parts():
    """The register kernel's row parts: two powers of two where they hold fewer lanes than one padded part."""
    assert [k_parts(k) for k in (576, 1536, 4096, 14336, 48, 90, 100, 1)] == \
        [(512, 64), (1024, 512), (4096, 0), (16384, 0), (32, 16), (64, 32), (128, 0), (1, 0)]


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("kind", ["norm", "norm+swiglu"])
def test_decode_linear_k_parts_modes(monkeypatch, exact, kind):
    """One padded part (EXACT_K off) and two parts give the reference at SmolLM2's K (576 = 512 + 64), 2 rows."""
    monkeypatch.setattr(dl, "EXACT_K", exact)
    x, w, g, r = _inputs(32, 576, torch.float32, DEV, seed=5, M=2)
    kw = _kind_kwargs(kind, g, r)
    _check(decode_linear(x, w, config=DecodeLinearConfig(BLOCK_N=4, num_warps=4), **kw),
           decode_linear_reference(x, w, **kw), torch.float32)


def test_default_kernel_by_rows():
    """One or two rows take the register kernel, more the tile kernel: all give the reference (default configs)."""
    x, w, g, r = _inputs(40, 64, torch.float32, DEV, M=6)
    for m in (1, 2, 6):
        _check(decode_linear(x[:m], w, norm_weight=g), decode_linear_reference(x[:m], w, norm_weight=g),
               torch.float32)
    assert default_tile_config(4, 6144, 4096) == TileConfig(16, 256, 4, 4)
    # a small weight: small register tiles (SmolLM2's sweeps) that let the next launch in at their start; a large
    # one: the 8B rule, which lets it in at its end
    assert default_decode_config(960, 576, M=2) == DecodeLinearConfig(4, 4, "start")
    assert default_decode_config(1536, 576, True, M=2) == DecodeLinearConfig(8, 4, "start")
    assert default_decode_config(576, 1536, M=2) == DecodeLinearConfig(2, 4, "start")
    assert default_decode_config(6144, 4096, M=2) == default_decode_config(6144, 4096)
    assert default_decode_config(6144, 4096).trigger == "end"
    assert default_decode_config(960, 576) == DecodeLinearConfig(4, 4, "start")
    # 17-64 rows: the whole-K tile where it fits shared memory (bf16 SwiGLU at SmolLM2's gate/up; float32 at its
    # down projection does not: 288 KB), else the K loop (the 8B shape's K = 4096 is too wide)
    assert default_tile_config(49, 1536, 576, pairs=True) == TileConfig(64, 0, 4, 1, 32)
    assert default_tile_config(49, 576, 1536) == TileConfig(16, 0, 4, 1, 32)
    assert default_tile_config(49, 576, 1536, elem_bytes=4) == TileConfig(16, 64, 4, 3)
    assert default_tile_config(49, 6144, 4096) == TileConfig(16, 64, 4, 3)


def test_residual_in_place_and_shapes():
    x, w, _, r = _inputs(24, 64, torch.float32, DEV, M=2)
    ref = decode_linear_reference(x, w, residual=r)
    out = decode_linear(x, w, residual=r, out=r)            # the residual stream updated in place
    assert out.data_ptr() == r.data_ptr() and torch.allclose(r, ref, atol=1e-5)
    assert decode_linear(x[0], w).shape == (24,)            # a [K] row gives [N]
    assert decode_linear(x.view(2, 1, 64), w, swiglu=True).shape == (2, 1, 12)


def test_reference_is_the_modules():
    """The reference computes what the eager modules compute: RMSNorm, a linear, SwiGLU, the residual add."""
    from eyas.layers.norm import RMSNorm
    x, w, g, r = _inputs(24, 64, torch.float32, "cpu")
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = g
    lin = torch.nn.Linear(64, 24, bias=False)
    lin.weight.data = w
    h = lin(norm(x))
    torch.testing.assert_close(decode_linear_reference(x, w, norm_weight=g), h)
    torch.testing.assert_close(decode_linear_reference(x, w, residual=r), r + lin(x))
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(decode_linear_reference(x, w, norm_weight=g, swiglu=True),
                               torch.nn.functional.silu(gate) * up)


def test_errors():
    x, w, g, r = _inputs(24, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="1 to 64 rows"):
        decode_linear(torch.zeros(65, 64), w)
    with pytest.raises(ValueError, match="1 to 8 rows"):  # the register kernel re-reads x: meant for one row
        decode_linear(torch.zeros(9, 64), w, config=DecodeLinearConfig())
    with pytest.raises(TypeError, match="TileConfig"):
        decode_linear(x, w, config={"BLOCK_N": 4})
    with pytest.raises(ValueError, match="contiguous weight"):
        decode_linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="weight"):
        decode_linear(x, w[:, :32].contiguous())
    with pytest.raises(ValueError, match="swiglu"):
        decode_linear(x, w[:23].contiguous(), swiglu=True)
    with pytest.raises(ValueError, match="norm_weight"):
        decode_linear(x, w, norm_weight=g[:10])
    with pytest.raises(ValueError, match="norm_weight"):  # the model's norms are in its dtype
        decode_linear(x, w, norm_weight=g.double())
    with pytest.raises(ValueError, match="residual"):
        decode_linear(x, w, residual=r[:, :5])
    with pytest.raises(ValueError, match="overlaps x"):  # a residual may be updated in place, x may not
        decode_linear(x, torch.zeros(64, 64), residual=x.clone(), out=x)
    with pytest.raises(ValueError, match="power of two"):
        DecodeLinearConfig(BLOCK_N=3)
    with pytest.raises(ValueError, match="trigger"):
        DecodeLinearConfig(trigger="never")
    with pytest.raises(ValueError, match="power of two >= 16"):
        TileConfig(BLOCK_N=8)
    with pytest.raises(ValueError, match="BLOCK_M"):
        TileConfig(BLOCK_M=8)
    with pytest.raises(ValueError, match="first_w"):
        TileConfig(BLOCK_K=0, first_w=True)


def test_default_configs_fit_registers():
    """<= 128 weights a thread (more spill on sm_90), and the 8B shapes get the swept configs."""
    for N, K, sw in [(6144, 4096, False), (4096, 14336, False), (14336, 4096, True), (960, 576, False),
                     (576, 1536, False), (49152, 576, False), (7, 33, True)]:
        c = default_decode_config(N, K, sw)
        kp = 1 << (K - 1).bit_length()
        assert c.BLOCK_N * kp <= 128 * 32 * c.num_warps and (c.BLOCK_N >= 2 or not sw)
    assert default_decode_config(6144, 4096) == DecodeLinearConfig(4, 8, "end")
    assert default_decode_config(4096, 14336) == DecodeLinearConfig(2, 8, "end")
    # FP8 codes: <= 128 a thread too (they become float32 registers), twice the bf16 rows at K = 4096
    for N, K, sw in [(6144, 4096, False), (4096, 14336, False), (14336, 4096, True), (4096, 8192, False),
                     (32768, 4096, False), (960, 576, False), (49152, 576, False), (7, 33, True)]:
        c = default_decode_config(N, K, sw, weight_bytes=1)
        kp = 1 << (K - 1).bit_length()
        assert c.BLOCK_N * kp <= 128 * 32 * c.num_warps and (c.BLOCK_N >= 2 or not sw)
    assert default_decode_config(32768, 4096, weight_bytes=1) == DecodeLinearConfig(8, 8, "end")
    assert default_decode_config(4096, 14336, weight_bytes=1) == DecodeLinearConfig(2, 8, "end")
    # beside 3-8 rows of x, 14336-wide rows take half (128 codes a thread spilled there)
    assert default_decode_config(4096, 14336, M=4, weight_bytes=1) == DecodeLinearConfig(1, 8, "end")
    assert default_decode_config(6144, 4096, M=4, weight_bytes=1) == DecodeLinearConfig(8, 8, "end")


def _qkv_case(NQ, KVH, D, K, dtype, device, dst, seed=0, M=None):
    g = torch.Generator(device=device).manual_seed(seed)
    M = M or len(dst)
    rope = RotaryEmbedding(D, 64, 500000.0, {"factor": 8.0, "original_max_position_embeddings": 32}).to(device)
    w = (torch.randn((NQ + 2 * KVH) * D, K, generator=g, device=device) * K ** -0.5).to(dtype)
    x = (torch.randn(M, K, generator=g, device=device) * 2).to(dtype)
    nw = (torch.randn(K, generator=g, device=device) * 0.2 + 1).to(dtype)
    stores = [torch.randn(8, KVH, D, generator=g, device=device).to(dtype) for _ in range(2)]
    pos = (torch.tensor([41, 7, 63, 0, 12, 30, 5, 44], device=device) * (1 + torch.arange(M, device=device)[:, None])
           % 64).T.reshape(-1)[:M]
    dst = torch.tensor(dst, device=device) if dst is not None else None
    return (x, w, nw, 1e-5, pos, dst, rope.cos, rope.sin), stores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("NQ,KVH,D,K,block_n", [(4, 2, 16, 48, 4), (3, 1, 8, 40, 2), (6, 2, 8, 33, 8)])
@pytest.mark.parametrize("dst", [[3], [-1], [5, 2, 7], [2, -1, 6, 3, 7, -1, 4, 5]])
def test_decode_qkv_rope_matches_reference(dtype, NQ, KVH, D, K, block_n, dst):
    """RoPE on q and k at each token's position, k and v into the row stores at each token's row (none for a
    negative one), q returned: as the projection followed by rope_store, for pair counts that leave a tail
    program."""
    args, (kd, vd) = _qkv_case(NQ, KVH, D, K, dtype, DEV, dst, seed=NQ * K + len(dst))
    kd_ref, vd_ref = kd.clone(), vd.clone()
    keep_k, keep_v = kd.clone(), vd.clone()
    q = decode_qkv_rope(*args, kd, vd, NQ, config=DecodeLinearConfig(BLOCK_N=block_n, num_warps=2))
    q_ref = decode_qkv_rope_reference(*args, kd_ref, vd_ref, NQ)
    _check(q, q_ref, dtype)
    # the reference writes a negative row's K/V to the scratch row 0; the kernel leaves rows 0 and 1 alone
    for got, ref, keep in ((kd, kd_ref, keep_k), (vd, vd_ref, keep_v)):
        _check(got[2:], ref[2:], dtype)
        assert torch.equal(got[:2], keep[:2])
        for row in range(2, 8):
            assert torch.equal(got[row], keep[row]) == (row not in dst)


def _fp8(w):
    from eyas.layers.linear_fp8 import quantize_fp8
    q, sc = quantize_fp8(w.float())
    return q.to(w.device), sc.to(w.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K,block_n", [(24, 64, 4), (13, 48, 8), (10, 100, 2)])
@pytest.mark.parametrize("kind", ["plain", "norm", "residual", "norm+swiglu"])
@pytest.mark.parametrize("M", [1, 3])
def test_decode_linear_fp8_matches_reference(dtype, N, K, block_n, kind, M):
    """FP8 codes with a scale per row (scale=): each prologue/epilogue against the reference over the dequantised
    weight (rows whose scales span two orders of magnitude, so that a missing or misplaced scale shows)."""
    if "swiglu" in kind:
        N *= 2
    x, w, g, r = _inputs(N, K, dtype, DEV, seed=N * K + M + 1, M=M)
    w = w * torch.logspace(-1, 1, N, device=w.device, dtype=torch.float32)[:, None].to(dtype)
    q, sc = _fp8(w)
    kw = _kind_kwargs(kind, g, r)
    got = decode_linear(x, q, scale=sc, config=DecodeLinearConfig(BLOCK_N=block_n, num_warps=2), **kw)
    _check(got, decode_linear_reference(x, q, scale=sc, **kw), dtype)
    from eyas.layers.linear_fp8 import dequantize_fp8  # the reference is the dequantised weight's
    torch.testing.assert_close(decode_linear_reference(x, q, scale=sc, **kw),
                               decode_linear_reference(x, dequantize_fp8(q, sc), **kw))
    # the default config takes FP8 weights on the register kernel (FP8_TILE_FACTOR times the weights)
    _check(decode_linear(x, q, scale=sc, **kw), decode_linear_reference(x, q, scale=sc, **kw), dtype)


@pytest.mark.parametrize("dst", [[3], [5, 2, 7]])
def test_decode_qkv_rope_fp8_matches_reference(dst):
    args, (kd, vd) = _qkv_case(4, 2, 16, 48, torch.float32, DEV, dst, seed=7 + len(dst))
    q8, sc = _fp8(args[1])
    args = (args[0], q8) + args[2:]
    kd_ref, vd_ref = kd.clone(), vd.clone()
    q = decode_qkv_rope(*args, kd, vd, 4, config=DecodeLinearConfig(BLOCK_N=4, num_warps=2), scale=sc)
    q_ref = decode_qkv_rope_reference(*args, kd_ref, vd_ref, 4, scale=sc)
    _check(q, q_ref, torch.float32)
    _check(kd, kd_ref, torch.float32)
    _check(vd, vd_ref, torch.float32)


def test_fp8_errors():
    x, w, g, r = _inputs(24, 64, torch.float32, "cpu")
    q, sc = _fp8(w)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        decode_linear(x, w, scale=sc)
    with pytest.raises(ValueError, match="scale must be 24"):
        decode_linear(x, q, scale=sc[:5])
    with pytest.raises(ValueError, match="scale must be 24"):
        decode_linear(x, q, scale=sc.double())
    with pytest.raises(ValueError, match="weight"):  # codes without their scale
        decode_linear(x, q)
    with pytest.raises(ValueError, match="register kernel"):  # the tile kernel takes no codes
        decode_linear(torch.zeros(9, 64), q, scale=sc)
    with pytest.raises(ValueError, match="register kernel"):
        decode_linear(x, q, scale=sc, config=TileConfig())


@pytest.mark.parametrize("uniform,preload", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("kernel", ["register", "tile"])
def test_qkv_rope_epilogue_switches(monkeypatch, uniform, preload, kernel):
    """The RoPE epilogue's variants (`UNIFORM_PAIRS`: a program whose rows lie in one half of one head stores to
    q, k or v alone; `PRELOAD_ROPE`: its tables loaded before the GEMV) all give the reference, to given rows and
    to a stash."""
    import eyas.kernels.decode_linear as dl
    monkeypatch.setattr(dl, "UNIFORM_PAIRS", uniform)
    monkeypatch.setattr(dl, "PRELOAD_ROPE", preload)
    cfg = (TileConfig(BLOCK_N=32, BLOCK_K=16, num_warps=2, num_stages=2) if kernel == "tile"
           else DecodeLinearConfig(BLOCK_N=4, num_warps=2))
    for dst, M, kw in (([5, -1, 2], 3, {}), (None, 6, dict(seq_q=3, seq_rows=5, row_offset=1))):
        args, _ = _qkv_case(3, 1, 32, 40, torch.float32, DEV, dst, seed=M, M=M)
        g = torch.Generator(device=DEV).manual_seed(1)
        kd, vd = (torch.randn(10, 1, 32, generator=g, device=DEV) for _ in range(2))
        kd_ref, vd_ref = kd.clone(), vd.clone()
        q = decode_qkv_rope(*args, kd, vd, 3, config=cfg, **kw)
        _check(q, decode_qkv_rope_reference(*args, kd_ref, vd_ref, 3, **kw), torch.float32)
        _check(kd[2:], kd_ref[2:], torch.float32)  # the reference writes a negative row's K/V to row 0
        _check(vd[2:], vd_ref[2:], torch.float32)


def test_decode_qkv_rope_errors():
    args, (kd, vd) = _qkv_case(4, 2, 16, 48, torch.float32, "cpu", [3])
    x, w = args[:2]
    with pytest.raises(ValueError, match="q/k/v projection"):
        decode_qkv_rope(x, w[:-16].contiguous(), *args[2:], kd, vd, 4)
    with pytest.raises(ValueError, match="q/k/v projection"):
        decode_qkv_rope(*args, kd, vd, 5)
    with pytest.raises(ValueError, match="row stores"):
        decode_qkv_rope(*args, kd[:, :1], vd, 4)
    with pytest.raises(ValueError, match="a position and a destination row per token"):
        decode_qkv_rope(torch.zeros(2, 48), *args[1:], kd, vd, 4)
    with pytest.raises(ValueError, match="cos/sin"):
        decode_qkv_rope(*args[:6], args[6][:, :8], args[7], kd, vd, 4)
    args2, (kd, vd) = _qkv_case(4, 2, 16, 48, torch.float32, "cpu", None, M=4)
    with pytest.raises(ValueError, match="without dst_rows"):  # 2 sequences of 2 tokens at rows 3..4 of 4 each
        decode_qkv_rope(*args2[:5], None, *args2[6:], kd, vd, 4, seq_rows=4, row_offset=3, seq_q=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("NQ,KVH,D,K", [(4, 2, 16, 48), (3, 1, 32, 40)])
@pytest.mark.parametrize("M,where,kernel", [(3, [5, -1, 2], "tile"), (6, (2, 4, 1), "tile"), (20, (1, 24, 3), "tile"),
                                            (40, (4, 12, 2), "tile"), (40, (4, 12, 2), "tile_m16"),
                                            (20, [3, -1, 7, 17, 5, 6, 2, 1, 4, -1, 9, 8, 11, 10, 12, 13, 14, 15, -1,
                                                  16], "tile_m16"), (40, (4, 12, 2), "tile_whole_k"),
                                            (3, [5, -1, 2], "tile_whole_k"), (40, (4, 12, 2), "tile_first_w"),
                                            (2, (1, 5, 3), "register"),
                                            (6, (3, 4, 2), "register"), (1, (1, 3, 2), "register")])
@pytest.mark.parametrize("norm", [True, False])
def test_stash_qkv_rope_matches_reference(dtype, NQ, KVH, D, K, M, where, kernel, norm):
    """RoPE and the K/V store of both kernels: to given rows (negative ones skipped), or to a stash's rows (seq_q
    tokens a sequence at row_offset of seq_rows rows each), the rows around them untouched; with the input norm or
    without (an EAGLE draft's first layer)."""
    dst = where if isinstance(where, list) else None
    args, _ = _qkv_case(NQ, KVH, D, K, dtype, DEV, dst, seed=M * K, M=M)
    kw = {}
    if dst is None:
        seq_q, seq_rows, row_offset = M // where[0], where[1], where[2]
        kw = dict(seq_q=seq_q, seq_rows=seq_rows, row_offset=row_offset)
        written = {b * seq_rows + row_offset + i for b in range(where[0]) for i in range(seq_q)}
        n_rows = where[0] * seq_rows
    else:
        written, n_rows = {d for d in dst if d >= 0}, max(8, max(dst) + 1)
    g = torch.Generator(device=DEV).manual_seed(1)
    kd, vd = (torch.randn(n_rows, KVH, D, generator=g, device=DEV).to(dtype) for _ in range(2))
    kd_ref, vd_ref, keep_k, keep_v = kd.clone(), vd.clone(), kd.clone(), vd.clone()
    cfg = (TileConfig(BLOCK_N=32, BLOCK_K=32, num_warps=2, num_stages=2) if kernel == "tile"
           else TileConfig(BLOCK_N=32, BLOCK_K=32, num_warps=2, num_stages=2, BLOCK_M=16) if kernel == "tile_m16"
           else TileConfig(BLOCK_N=32, BLOCK_K=0, num_warps=2, num_stages=1, BLOCK_M=16) if kernel == "tile_whole_k"
           else TileConfig(BLOCK_N=32, BLOCK_K=16, num_warps=2, num_stages=2, first_w=True) if kernel == "tile_first_w"
           else DecodeLinearConfig(BLOCK_N=4, num_warps=2))
    if not norm:
        args = (args[0], args[1], None, *args[3:])
    q = decode_qkv_rope(*args, kd, vd, NQ, config=cfg, **kw)
    _check(q, decode_qkv_rope_reference(*args, kd_ref, vd_ref, NQ, **kw), dtype)
    for got, ref, keep in ((kd, kd_ref, keep_k), (vd, vd_ref, keep_v)):
        for row in range(n_rows):
            if row in written:
                _check(got[row], ref[row], dtype)
            elif row:  # the reference writes a negative row's K/V to row 0
                assert torch.equal(got[row], keep[row])


# ---- the one-row decode step ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_row")
    target = write_tiny_llama(root / "t", vocab=37, hidden=48, heads=4, kv_heads=2, layers=3)
    draft = write_random_draft(root / "d", target, layers=1, scale=0.3)
    return target, draft


def _llm(paths, one_row, draft=None, spec=None, dtype="float32", few_rows=False, triton_attention=True):
    llm = LLM(str(paths[0]), device=DEV, dtype=dtype, draft=str(draft) if draft else None, speculation=spec,
              max_model_len=SHORT_CONTEXT)
    for m in (llm.target, llm.draft):
        if m is not None:
            enable_fast_path(m, one_row=one_row, few_rows=bool(few_rows))
    if few_rows and few_rows is not True:  # a number: the most rows the path takes (FEW_ROWS_MAX by default)
        llm.target.few_rows_max = few_rows
    # Triton attention and KV writes too (interpreted on the CPU); the row paths need them. Without (the references
    # of the tests below): the attention's torch reference, an oracle independent of the kernels, and much faster
    # than the interpreter
    llm.engine.runner.use_triton = triton_attention
    return llm


def _run_recording(paths, one_row, prompts, n, draft=None, spec=None, few_rows=False, triton_attention=True):
    """Greedy decoding; returns (tokens, the logits of every target call, how many steps took the row path)."""
    from eyas.models import one_row as mod
    llm = _llm(paths, one_row, draft, spec, few_rows=few_rows, triton_attention=triton_attention)
    logits, calls = [], []
    head, step = llm.target.compute_logits, mod.forward_rows

    def record(*a, **k):
        out = head(*a, **k)
        logits.append(out.float().reshape(-1, out.shape[-1]).clone())
        return out

    def counting(*a, **k):
        calls.append(1)
        return step(*a, **k)
    llm.target.compute_logits = record
    mod.forward_rows = counting
    try:
        out = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    finally:
        mod.forward_rows = step
    return [o.token_ids for o in out], logits, len(calls)


def _same(a, b):
    assert a[0] == b[0]
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_attention_pdl_is_asked_by_the_row_paths_and_taken_only_on_the_gpu(tiny, monkeypatch):
    """The one-row and few-rows paths ask the attention kernels for programmatic dependent launch where their
    linears take it (`use_pdl`: sm_90); the kernels take it only when `tree_attention.PDL` is on and not under the
    interpreter (the GPU tests below run the row paths with it on and off)."""
    from eyas.kernels import tree_attention as ta
    from eyas.models import one_row as mod
    asked = []
    gdc = ta._gdc
    monkeypatch.setattr(ta, "_gdc", lambda pdl: (asked.append(pdl), gdc(pdl))[1])
    monkeypatch.setattr(mod, "use_pdl", lambda device: True)
    monkeypatch.setattr(ta, "PDL", True)
    _run_recording(tiny, True, [[1, 2, 3, 4]], 3, tiny[1], "chain:2", few_rows=True)
    assert True in asked
    if INTERPRET:
        assert gdc(True) == (False, {})  # the interpreter never takes PDL
    from eyas.kernels import interpret
    monkeypatch.setattr(interpret, "interpreting", lambda: False)  # what the launch takes on a GPU
    assert gdc(True) == (True, {"launch_pdl": True}) and gdc(False) == (False, {})
    monkeypatch.setattr(ta, "PDL", False)
    assert gdc(True) == (False, {})


def test_fused_path_asks_pdl_only_where_switched_on(tiny, monkeypatch):
    """`eyas.models.llama.FUSED_PDL` on a PDL GPU: the fused path's RoPE + K/V store launch and its attention kernels
    are asked for programmatic dependent launch (here a chain's verify passes and the draft's catch-up); off, none
    of them is; plain decode steps never are; the RoPE + store kernel, like the attention, takes it only off the
    interpreter (the GPU test below holds the tokens to those without it)."""
    import eyas.kernels as kernels
    from eyas.kernels import fused_rope
    from eyas.kernels import tree_attention as ta
    from eyas.models import llama
    from eyas.models import one_row as mod
    asked, rope_asked = [], []
    gdc, rope_store = ta._gdc, kernels.rope_store_triton
    monkeypatch.setattr(ta, "_gdc", lambda pdl: (asked.append(pdl), gdc(pdl))[1])
    monkeypatch.setattr(kernels, "rope_store_triton", lambda *a, **k: (rope_asked.append(k.get("pdl")),
                                                                       rope_store(*a, **k))[1])
    monkeypatch.setattr(mod, "use_pdl", lambda device: True)
    for on in (False, True):
        monkeypatch.setattr(llama, "FUSED_PDL", on)
        asked.clear(), rope_asked.clear()
        _run_recording(tiny, False, [[1, 2, 3, 4]], 2, tiny[1], "chain:2")  # the fused path (no row paths)
        assert rope_asked and set(rope_asked) == {on} and set(asked) == {on}
    # plain decode steps never ask (8B at batch 32 was slower with it): their RoPE + store and prefix pass, while
    # the prefill chunks before them still follow the switch
    prefix_asked = []
    prefix = llama.prefix_only_attention
    monkeypatch.setattr(llama, "prefix_only_attention", lambda *a, **k: (prefix_asked.append(k["pdl"]),
                                                                          prefix(*a, **k))[1])
    asked.clear(), rope_asked.clear()
    _run_recording(tiny, False, [[1, 2, 3, 4], [5, 6]], 3)
    assert set(rope_asked) == {False} and set(prefix_asked) == {False} and True in asked
    launched = []

    class Launch:  # records what a launch of the RoPE + store kernel is given
        def __getitem__(self, grid):
            return lambda *a, **k: launched.append((k["USE_GDC"], k.get("launch_pdl")))
    monkeypatch.setattr(fused_rope, "_rope_store_kernel", Launch())
    q = torch.randn(1, 2, 4, 8)
    kv = torch.randn(1, 2, 2, 8)
    tables = torch.randn(16, 8)
    dst = torch.zeros(4, 2, 8)

    def launch(pdl):
        fused_rope.rope_store_triton(torch.tensor([[0, 1]]), q, kv, kv, tables, tables, dst, dst,
                                     rows=torch.tensor([[1, 2]]), pdl=pdl)
        return launched.pop()
    if INTERPRET:
        assert launch(True) == (False, None)  # the interpreter never takes PDL
    from eyas.kernels import interpret
    monkeypatch.setattr(interpret, "interpreting", lambda: False)  # what the launch takes on a GPU
    assert launch(True) == (True, True) and launch(False) == (False, None)


def test_batch1_plain_decoding_takes_one_row_and_equals_the_fused_path(tiny):
    """Every decode step after the prefill's token takes the path, with the fused path's tokens and logits."""
    ref = _run_recording(tiny, False, [[1, 2, 3, 4]], 5, triton_attention=False)
    got = _run_recording(tiny, True, [[1, 2, 3, 4]], 5)
    assert ref[2] == 0 and got[2] == 4
    _same(got, ref)


def test_one_row_taps_feature_layers():
    """A plain decode step that asks for feature layers (an EAGLE-3 draft's, at a bare-root step): the features
    equal the fused path's."""
    from eyas.config import ModelConfig
    from eyas.models.llama import LlamaForCausalLM
    from eyas.models.one_row import forward_rows
    cfg = ModelConfig(vocab_size=37, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(DEV)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    enable_fast_path(model)
    from eyas.cache.kv_cache import KVCache
    from eyas.layers.attention import AttentionMetadata
    cache = KVCache.allocate(cfg, 3, 4, 16, torch.float32, torch.device(DEV))
    for t in (cache.k, cache.v):
        t.normal_()
    meta = AttentionMetadata(block_tables=torch.tensor([[2, 0]], device=DEV), context_lens=torch.tensor([20], device=DEV),
                             max_context_len=20, block_size=16, suffix_mask=None,
                             slot_mapping=torch.tensor([[3]], device=DEV), use_triton=True, prefix_includes_new=True)
    ids, pos = torch.tensor([[5]], device=DEV), torch.tensor([[19]], device=DEV)
    with torch.no_grad():
        h1, f1 = forward_rows(model, model.embed(ids), pos, meta, cache, feature_layers=(2, 0))
        model.one_row = False
        h0, f0 = model(ids, pos, meta, cache, feature_layers=(2, 0))
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f1, f0, atol=1e-5, rtol=1e-5)
    assert f1.shape == (1, 1, 3 * 48)
    # an EAGLE-3 checkpoint's taps (`RawTaps`): the residual streams themselves, no final state, as the reference
    # path (the eager modules) gives them
    from eyas.models.llama import RawTaps
    raw = RawTaps((2, 0))
    with torch.no_grad():
        model.one_row = True
        _, r1 = forward_rows(model, model.embed(ids), pos, meta, cache, feature_layers=raw)
        model.one_row = False
        _, r0 = model(ids, pos, meta, cache, feature_layers=raw)
        model.fused_ops = False
        _, ref = model(ids, pos, meta, cache, feature_layers=raw)
    assert ref.shape == (1, 1, 2 * 48)
    torch.testing.assert_close(r1, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r0, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("B,Q,layers,out", [(1, 1, 1, "view"), (1, 3, 1, None), (2, 3, 2, "view"), (2, 1, 1, None)])
def test_draft_levels_on_rows_equal_the_fused_path(B, Q, layers, out, quant):
    """An EAGLE draft's tree level (K/V to the stash, the suffix over its rows) on `forward_draft_rows`: the fused
    path's output, stash rows and nothing else written; one and two layers (the first without input norm), into a
    view of a larger buffer (strided at batch 2) or a new tensor; an FP8 draft's (`--draft-quant fp8`: the codes
    and scales on the register kernel, against the fused path's dequantised weights)."""
    from eyas.cache.kv_cache import KVCache
    from eyas.config import ModelConfig
    from eyas.layers.attention import AttentionMetadata, Stash
    from eyas.models import one_row as mod
    from eyas.models.eagle import EagleDraft
    cfg = ModelConfig(vocab_size=37, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    torch.manual_seed(B * 10 + Q + layers)
    draft = EagleDraft(cfg).to(DEV)
    for p in draft.parameters():
        p.data.normal_(0, 0.15)
    if quant:
        from eyas.spec.draft_quant import fp8_linears
        fp8_linears(draft)
        draft.to(DEV)
    enable_fast_path(draft)
    # a small draft: tree levels of 1 to FEW_ROWS_MAX (64) tokens; FP8 codes take the register kernel alone (no
    # scales in the tile kernel): 1 to 8
    assert draft.few_rows and draft.few_rows_max == (8 if quant else 64)
    cache = KVCache.allocate(cfg, layers, 6, 16, torch.float32, torch.device(DEV))
    for t in (cache.k, cache.v):
        t.normal_()
    R = 1 + 2 * Q  # rows 1 .. Q an earlier level, Q + 1 .. 2Q this one
    stash = Stash.like(cache, B, R)
    for t in (stash.k, stash.v):
        t.normal_()
    mask = torch.rand(B, Q, 2 * Q, generator=torch.Generator().manual_seed(1)) < 0.6
    mask[:, :, Q:] = torch.eye(Q, dtype=torch.bool)  # each token sees itself and some of the earlier level
    meta = AttentionMetadata(block_tables=torch.tensor([[2, 0], [4, 5]], device=DEV)[:B],
                             context_lens=torch.tensor([20, 17], device=DEV)[:B], max_context_len=20, block_size=16,
                             suffix_mask=mask.to(DEV), use_triton=True, stash=stash, stash_at=Q + 1, suffix_from=1)
    pairs = torch.randn(B, Q, 96, device=DEV)
    pos = torch.tensor([[19], [16]])[:B].expand(B, Q).contiguous().to(DEV)
    results = []
    for rows in (True, False):
        draft.few_rows = rows
        s = Stash(stash.k.clone(), stash.v.clone())
        m = AttentionMetadata(**{**meta.__dict__, "stash": s})
        buf = torch.full((B, R, 48), 7.0, device=DEV) if out else None
        dst = buf[:, Q + 1:] if out else None
        calls = []
        step = mod.forward_draft_rows
        mod.forward_draft_rows = lambda *a, **k: calls.append(1) or step(*a, **k)
        try:
            with torch.no_grad():
                y = draft.forward_pairs(pairs, pos, m, cache, out=dst)
        finally:
            mod.forward_draft_rows = step
        assert len(calls) == (1 if rows else 0)
        results.append((y.clone(), s, buf))
    (y1, s1, b1), (y0, s0, b0) = results
    # float32: only the order of the sums differs (the fused path's are cuBLAS's or torch's); on a GPU an FP8
    # draft's fused path at more than two rows is the FP8 GEMV, whose tensor cores take x in float16
    tol = 2e-3 if quant and DEV == "cuda" and B * Q > 2 else 1e-4
    torch.testing.assert_close(y1, y0, atol=tol, rtol=tol)
    torch.testing.assert_close(s1.k, s0.k, atol=tol, rtol=tol)
    torch.testing.assert_close(s1.v, s0.v, atol=tol, rtol=tol)
    if out:
        assert torch.equal(b1[:, :Q + 1], b0[:, :Q + 1]) and (b1[:, :Q + 1] == 7.0).all()


def test_large_drafts_take_rows_at_one_or_two_tokens():
    """A draft wider than FEW_ROWS_MAX_HIDDEN takes tree levels of 1 or 2 tokens on the register kernel (FP8 codes: 1
    only, what its wide linears take there, session 44), more on the fused path; a small FP8 draft up to the register
    kernel's REGISTER_ROWS."""
    from types import SimpleNamespace
    from eyas.layers.linear_fp8 import WIDE_DIM, Fp8Linear
    from eyas.models import one_row as mod
    big, small = (SimpleNamespace(config=SimpleNamespace(hidden_size=h), fc=torch.nn.Linear(2, 2)) for h in (4096, 576))
    assert mod.draft_rows_max(big) == mod.LARGE_DRAFT_ROWS_MAX == 2
    assert mod.draft_rows_max(small) == mod.FEW_ROWS_MAX
    big8, small8 = (SimpleNamespace(config=SimpleNamespace(hidden_size=h), fc=Fp8Linear.from_linear(torch.nn.Linear(
        2 * w, w))) for h, w in ((4096, WIDE_DIM + 64), (576, 576)))
    assert mod.draft_rows_max(big8) == 1
    assert mod.draft_rows_max(small8) == dl.REGISTER_ROWS
    meta = SimpleNamespace(use_triton=True, stash=object())
    draft = SimpleNamespace(few_rows=True, few_rows_max=2,
                            layers=[SimpleNamespace(post_attention_layernorm=SimpleNamespace(weight=torch.ones(2)))])
    assert [mod.takes_draft_rows(draft, torch.zeros(1, q, 4), meta) for q in (1, 2, 3)] == [True, True, False]
    assert not mod.takes_draft_rows(draft, torch.zeros(1, 1, 4, dtype=torch.float64), meta)  # another dtype


def test_engine_config_switches_it(tiny):
    """EngineConfig(one_row=False, few_rows=False) (`eyas bench latency --no-one-row --no-few-rows`) keeps every
    step on the fused path."""
    from eyas.bench.latency import add_parser
    from eyas.engine.runner import ModelRunner
    from eyas.loader.resolve import load_target
    t, _ = load_target(str(tiny[0]), "cpu", torch.float32)
    ModelRunner(t, None, None, 8, 16, use_triton=True, one_row=False, few_rows=False)
    assert t.fused_ops and not t.one_row and not t.few_rows
    ModelRunner(t, None, None, 8, 16, use_triton=True, few_rows=False)
    assert t.one_row and not t.few_rows
    ModelRunner(t, None, None, 8, 16, use_triton=True)
    assert t.one_row and not t.few_rows  # a model on the CPU (the interpreter): few rows only where a test asks
    enable_fast_path(t)
    assert t.few_rows
    import argparse
    sub = argparse.ArgumentParser().add_subparsers()
    p = add_parser(sub)
    assert p.parse_args([]).one_row and not p.parse_args(["--no-one-row"]).one_row
    assert p.parse_args([]).few_rows and not p.parse_args(["--no-few-rows"]).few_rows


@pytest.mark.parametrize("prompts,spec", [([[1, 2, 3], [5, 6, 7, 8, 9, 10], [11]], None),
                                          ([[1, 2, 3, 4]], "chain:3"), ([[6, 2, 7]], "chain:1"),
                                          ([[1, 2, 3, 4], [9, 8]], "tree:8"),
                                          ([[3, 1, 4, 1, 5]], "tree:smollm2_48d5"),
                                          ([[1, 2, 3, 4], [9, 8], [5, 5, 5]], "dyn:k4d3n8")])
def test_few_rows_equal_the_fused_path(tiny, prompts, spec):
    """Batched plain decoding (3 rows a step) and verify passes (chain:3: 4 rows; chain:1: 2, on the register
    kernel; tree:8 at batch 2: 18 rows; the default tree: 49 rows; the dispatcher's dynamic tree for 3 to 16
    requests at batch 3: 27 rows) on the tile kernels, up to the kernel's 64 rows (FEW_ROWS_MAX since session 38):
    the fused path's tokens and the logits of every target call."""
    # the trees' verify passes are slow in the interpreter: tree:8 two of them, the default tree's 49 rows one (the
    # second took 11-25 s of CI's slowest test; tree:8 holds a verify pass after a commit on these kernels)
    n = {"tree:8": 3, "dyn:k4d3n8": 2, "tree:smollm2_48d5": 2}.get(spec, 4)
    ref = _run_recording(tiny, False, prompts, n, tiny[1] if spec else None, spec, triton_attention=False)
    got = _run_recording(tiny, True, prompts, n, tiny[1] if spec else None, spec, few_rows=64)
    assert ref[2] == 0 and got[2] >= (1 if n == 2 else 2)
    _same(got, ref)


def test_few_rows_limits(tiny):
    """The path takes 2 to FEW_ROWS_MAX tokens, and only models where it pays (hidden <= FEW_ROWS_MAX_HIDDEN)."""
    from eyas.layers.attention import AttentionMetadata
    from eyas.models.one_row import FEW_ROWS_MAX, takes_few_rows
    llm = _llm(tiny, True, few_rows=True)
    t = llm.target
    meta = AttentionMetadata(block_tables=None, context_lens=None, suffix_mask=None, max_context_len=0, block_size=16,
                             use_triton=True, prefix_includes_new=True)
    for rows, want in ((1, False), (2, True), (FEW_ROWS_MAX, True), (FEW_ROWS_MAX + 1, False)):
        assert takes_few_rows(t, torch.zeros(rows, 1, 48), meta) == want
    big = _llm(tiny, True, few_rows=True).target
    big.config.hidden_size = 4096  # as if it were the 8B shape: measured slower there, so not switched on
    enable_fast_path(big)
    assert big.one_row and not big.few_rows
    from eyas.models.one_row import draft_rows_ready
    d = _llm(tiny, True, tiny[1], "chain:3", few_rows=True).draft
    assert d.few_rows and draft_rows_ready(d)
    d.fc.register_forward_hook(lambda *a: None)  # as tensor parallelism's hooks: not ready
    assert not draft_rows_ready(d)


def test_other_steps_keep_the_fused_path(tiny):
    """Without `few_rows`, batched plain decoding (3 rows a step) and chain:3 verify passes (4 rows) do not take the
    path, and give the same tokens with it switched on; a hooked projection (tensor parallelism) makes a model not
    ready."""
    from eyas.models.one_row import one_row_ready
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10], [11]]
    got = _run_recording(tiny, True, prompts, 3)
    assert got[2] == 0 and got[0] == _run_recording(tiny, False, prompts, 3, triton_attention=False)[0]
    got = _run_recording(tiny, True, [[1, 2, 3, 4]], 3, tiny[1], "chain:3")
    assert got[2] == 0 and got[0] == _run_recording(tiny, False, [[1, 2, 3, 4]], 3, tiny[1], "chain:3",
                                                    triton_attention=False)[0]
    llm = _llm(tiny, True)
    assert llm.target.one_row and one_row_ready(llm.target)
    llm.target.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: None)  # as tensor parallelism does
    assert not one_row_ready(llm.target)


# ---- GPU ------------------------------------------------------------------------------------------------------
@pytest.fixture(params=[0, 64], ids=["loop_k", "whole_k"])
def whole_k(request, monkeypatch):
    """The tile launches' default configs with the K loop (WHOLE_K_ROWS 0) or the whole-K tile (up to 64 rows)."""
    import eyas.kernels.decode_linear as dl
    monkeypatch.setattr(dl, "WHOLE_K_ROWS", request.param)
    return request.param


@gpu
@pytest.mark.parametrize("N,K,kind", [(6144, 4096, "norm"), (4096, 4096, "residual"), (28672, 4096, "norm+swiglu"),
                                      (4096, 14336, "residual"), (960, 576, "norm"), (3072, 576, "norm+swiglu"),
                                      (576, 1536, "residual"), (49152, 576, "plain")])
@pytest.mark.parametrize("pdl,M", [(False, 1), (True, 1), (True, 4), (False, 4), (True, 16), (True, 49)])
def test_gpu_bf16_shapes(N, K, kind, pdl, M, whole_k):
    """One row: the register kernel; 4 to 49: the tile kernel (default configs, with and without the whole-K
    tile)."""
    x, w, g, r = _inputs(N, K, torch.bfloat16, "cuda", seed=N, M=M)
    kw = _kind_kwargs(kind, g, r)
    _check(decode_linear(x, w, pdl=pdl, **kw), decode_linear_reference(x, w, **kw), torch.bfloat16)


@gpu
@pytest.mark.parametrize("N,K,kind", [(4096, 8192, "plain"), (4096, 4096, "residual"), (28672, 4096, "norm+swiglu"),
                                      (4096, 14336, "residual"), (32768, 4096, "plain"), (3072, 576, "norm+swiglu"),
                                      (49152, 576, "plain")])
@pytest.mark.parametrize("pdl,M", [(False, 1), (True, 1), (True, 2), (True, 5)])
def test_gpu_fp8_shapes(N, K, kind, pdl, M):
    """FP8 codes (an FP8 draft's linears: fc, o, gate_up, down, a 32k head; SmolLM2's) on the register kernel at
    its default configs, against the dequantised reference."""
    x, w, g, r = _inputs(N, K, torch.bfloat16, "cuda", seed=N + 1, M=M)
    q, sc = _fp8(w)
    kw = _kind_kwargs(kind, g, r)
    _check(decode_linear(x, q, scale=sc, pdl=pdl, **kw), decode_linear_reference(x, q, scale=sc, **kw),
           torch.bfloat16)


@gpu
@pytest.mark.parametrize("NQ,KVH,D,K", [(32, 8, 128, 4096), (9, 3, 64, 576)])
def test_gpu_bf16_qkv_rope(NQ, KVH, D, K):
    args, (kd, vd) = _qkv_case(NQ, KVH, D, K, torch.bfloat16, "cuda", [5, 2, -1, 7])
    kd_ref, vd_ref = kd.clone(), vd.clone()
    for pdl in (False, True):
        _check(decode_qkv_rope(*args, kd, vd, NQ, pdl=pdl), decode_qkv_rope_reference(*args, kd_ref, vd_ref, NQ),
               torch.bfloat16)
        _check(kd[2:], kd_ref[2:], torch.bfloat16)  # the reference writes the negative row's K/V to row 0
        _check(vd[2:], vd_ref[2:], torch.bfloat16)


@gpu
@pytest.mark.parametrize("NQ,KVH,D,K", [(32, 8, 128, 4096), (9, 3, 64, 576)])
@pytest.mark.parametrize("M", [4, 49])
def test_gpu_bf16_qkv_rope_stash(NQ, KVH, D, K, M, whole_k):
    """The tile kernel's RoPE + store into a stash (a verify pass's rows 1 .. M of M + 3)."""
    args, _ = _qkv_case(NQ, KVH, D, K, torch.bfloat16, "cuda", None, M=M)
    kd = torch.zeros(M + 3, KVH, D, device="cuda", dtype=torch.bfloat16)
    vd, kd_ref, vd_ref = kd.clone(), kd.clone(), kd.clone()
    kw = dict(seq_q=M, seq_rows=M + 3, row_offset=1)
    _check(decode_qkv_rope(*args, kd, vd, NQ, pdl=True, **kw),
           decode_qkv_rope_reference(*args, kd_ref, vd_ref, NQ, **kw), torch.bfloat16)
    _check(kd, kd_ref, torch.bfloat16)
    _check(vd, vd_ref, torch.bfloat16)


@gpu
@pytest.mark.parametrize("spec,prompts", [("tree:smollm2_48d5", [[1, 2, 3, 4]]), ("chain:3", [[1, 2, 3, 4], [7, 3]]),
                                          (None, [[1, 2, 3, 4], [7, 3], [9]])])
def test_gpu_fused_path_pdl_changes_nothing(tiny, spec, prompts, monkeypatch):
    """bf16 on the GPU, CUDA graphs, the fused path (no row paths; `FUSED_PDL` lets its RoPE + store and attention
    launches overlap): PDL moves launches, not arithmetic, so the greedy tokens are those without it (a tree's
    49-row verify passes, chain:3 at batch 2 with its catch-up, plain decoding at batch 3)."""
    from eyas.models import llama
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def run(on):
        monkeypatch.setattr(llama, "FUSED_PDL", on)
        llm = LLM(str(tiny[0]), device="cuda", dtype="bfloat16", cuda_graphs=True,
                  draft=str(tiny[1]) if spec else None, speculation=spec)
        for m in (llm.target, llm.draft):
            if m is not None:
                enable_fast_path(m, one_row=False, few_rows=False)
        assert llama.fused_pdl(torch.device("cuda")) == (on and torch.cuda.get_device_capability()[0] >= 9)
        return [o.token_ids for o in llm.generate(prompts, params)]
    assert run(True) == run(False)


@gpu
@pytest.mark.parametrize("attn_pdl", [False, True])
def test_gpu_one_row_under_graphs_equals_fused_path(tiny, attn_pdl, monkeypatch):
    """bf16 on the GPU, CUDA graphs: the one-row path (with PDL on sm_90; `attn_pdl`: the attention kernels' too)
    gives the fused path's greedy tokens."""
    from eyas.kernels import tree_attention
    monkeypatch.setattr(tree_attention, "PDL", attn_pdl)
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def run(one_row):
        llm = LLM(str(tiny[0]), device="cuda", dtype="bfloat16", cuda_graphs=True)
        # fold=False: the fused path with the kernels' order of roundings (folded, its bf16 tokens may part ways)
        enable_fast_path(llm.target, one_row=one_row, fold=False)
        return [o.token_ids for o in llm.generate([[1, 2, 3, 4]], params)]
    assert run(True) == run(False)


@gpu
@pytest.mark.parametrize("attn_pdl", [False, True])
@pytest.mark.parametrize("spec,prompts", [("chain:3", [[1, 2, 3, 4], [7, 3]]), ("tree:smollm2_48d5", [[1, 2, 3, 4]])])
def test_gpu_few_rows_under_graphs_equals_fused_path(tiny, spec, prompts, attn_pdl, whole_k, monkeypatch):
    """bf16 on the GPU, CUDA graphs, speculative decoding: verify passes on the tile kernels (chain:3 at batch 2: 8
    rows; the default tree at batch 1: 49, the most rows raised to the kernel's 64) give the fused path's greedy
    tokens. The fused path runs unfolded (`fold=False`): with the norms folded into the projections
    (`fold_norms`) its roundings differ from the tile kernels', and in bf16 a random model's tokens part ways
    after ~10 (held instead by tests/test_fused_ops.py against float32). `attn_pdl`: the attention kernels with
    programmatic dependent launch too."""
    from eyas.kernels import tree_attention
    monkeypatch.setattr(tree_attention, "PDL", attn_pdl)
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def run(few_rows):
        llm = LLM(str(tiny[0]), device="cuda", dtype="bfloat16", cuda_graphs=True, draft=str(tiny[1]),
                  speculation=spec)
        enable_fast_path(llm.target, few_rows=few_rows, fold=False)
        llm.target.few_rows_max = 64
        return [o.token_ids for o in llm.generate(prompts, params)]
    assert run(True) == run(False)


def test_default_tiles_fit_sm90_shared_memory():
    """The default tile configs at SmolLM2's shapes (qkv + RoPE, o, gate/up, down; 16 and 49 rows; bf16 and
    float32), compiled offline for sm_90 (`helpers.compile_for_sm90`: Triton's own count of a launch's dynamic shared
    memory): each fits a block of the H200 (232,448 bytes, the limit its OutOfResources error names). Session 38's
    GPU graph test on SmolLM2 in float32 failed there: the whole-K tile for down at 49 rows asked 294,912."""
    pytest.importorskip("triton.compiler")
    from helpers import SMOLLM2_TILE_SHAPES, compile_for_sm90, tile_variant
    todo = [(M, s, dtype, dl.default_tile_config(M, s["N"], s["K"], s["pair"] > 0,
                                                 torch.empty(0, dtype=dtype).element_size()))
            for dtype in (torch.bfloat16, torch.float32) for M in (16, 49) for s in SMOLLM2_TILE_SHAPES.values()]
    assert sum(c.BLOCK_K == 0 for *_, c in todo) >= 12  # mostly the whole-K tile
    results = compile_for_sm90([tile_variant(M, cfg, dtype, **s) for M, s, dtype, cfg in todo])
    for (M, s, dtype, cfg), r in zip(todo, results):
        assert r["error"] is None and r["shared"] <= 232448, (M, s, dtype, cfg, r["error"], r.get("shared"))


def test_small_linears_let_the_next_launch_in_before_their_wait():
    """Where the default configs put the PDL trigger, in the sm_90 PTX (compiled offline): SmolLM2's one-row linears
    on the register kernel and its tile launches (the whole-K tile at 49 rows, the K loop for down at 16) let the
    next launch in before their own wait (session 39: the next kernel's programs load their weights while these
    compute), the 8B shape's one-row qkv (big grids, session 14) only before its stores, after the wait. And which
    of them issue their weight loads before the wait: the register kernel and the whole-K tile do, the K loop only
    with `TileConfig.first_w` (its first tile; off by default)."""
    import dataclasses
    pytest.importorskip("triton.compiler")
    from helpers import SMOLLM2_TILE_SHAPES, compile_for_sm90, register_variant, tile_variant
    bf16 = torch.bfloat16
    o, down = SMOLLM2_TILE_SHAPES["o"], SMOLLM2_TILE_SHAPES["down"]
    loop = dl.default_tile_config(16, down["N"], down["K"])
    early = [register_variant(1, dl.default_decode_config(o["N"], o["K"]), bf16, **o),
             tile_variant(49, dl.default_tile_config(49, o["N"], o["K"]), bf16, **o),
             tile_variant(16, loop, bf16, **down),
             tile_variant(16, dataclasses.replace(loop, first_w=True), bf16, **down)]
    assert [v[1] for v in early] == ["_decode_linear_kernel", "_tile_whole_k_kernel"] + ["_tile_linear_kernel"] * 2
    late = register_variant(1, dl.default_decode_config(6144, 4096), bf16, N=6144, K=4096)
    results = compile_for_sm90(early + [late])
    for r in results:
        assert r["error"] is None, r["error"]
    assert [r["gdc"] for r in results] == [["launch_dependents", "wait"]] * 4 + [["wait", "launch_dependents"]]
    assert [r["loads_before_wait"] > 0 for r in results] == [True, True, False, True, True]


@pytest.mark.parametrize("prompts,spec", [([[1, 2, 3, 4]], "chain:3"), ([[1, 2, 3, 4], [9, 8]], "tree:8")])
def test_catch_up_on_the_rows_path_equals_the_torch_path(tiny, monkeypatch, prompts, spec):
    """`eyas.spec.drafter.CATCHUP_ROWS` (on by default): the draft's catch-up on the tile kernels through a stash,
    committed to the draft cache in one launch, gives the tokens and the target logits of the PyTorch path (the
    draft's later proposals read the K/V it committed: three tokens, two verify passes, each tree drafted over the
    K/V the catch-ups before it committed); the catch-ups took it (forward_draft_rows at stash row 0, where a tree
    level's rows start at 1 or later)."""
    from eyas.models import one_row as mod
    from eyas.spec import drafter
    ref = _run_recording(tiny, False, prompts, 3, tiny[1], spec, triton_attention=False)
    catch_ups = []
    rows = mod.forward_draft_rows

    def counting(draft, pairs, positions, meta, *a, **k):
        catch_ups.append(meta.stash_at == 0)
        return rows(draft, pairs, positions, meta, *a, **k)
    monkeypatch.setattr(mod, "forward_draft_rows", counting)
    monkeypatch.setattr(drafter, "CATCHUP_ROWS", True)
    got = _run_recording(tiny, True, prompts, 3, tiny[1], spec, few_rows=64)
    assert sum(catch_ups) >= 2
    _same(got, ref)
