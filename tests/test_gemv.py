"""Triton GEMV (`eyas.kernels.gemv`) against its plain-PyTorch reference and F.linear.

Without CUDA the kernel runs under the Triton interpreter (TRITON_INTERPRET=1 is set here, before Triton is first
imported), on small shapes. With CUDA the same tests run the compiled kernel, and the `gpu` tests (Llama-8B
decode shapes in bf16, CUDA-graph capture) run too.

    .venv/bin/python -m pytest -q tests/test_gemv.py
"""
import os

import torch

if not torch.cuda.is_available():  # `import torch` does not import triton
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from eyas.kernels.gemv import GemvConfig, default_config, gemv_reference, gemv_triton  # noqa: E402

DEV = "cpu" if INTERPRET else "cuda"
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                         reason="needs CUDA and compiled (not interpreted) Triton kernels")

# Small configs for the interpreter: both paths, split-K off and on (3 splits do not divide K evenly).
CONFIGS = {
    "default": None,
    "ew": GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1),
    "ew_split3": GemvConfig(BLOCK_N=8, BLOCK_K=64, SPLIT_K=3),
    "dot": GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, use_dot=True),
    "dot_split2": dict(BLOCK_N=32, BLOCK_K=16, SPLIT_K=2, use_dot=True),
}
SHAPES = [(1, 37, 100), (3, 256, 576), (16, 1, 5), (1, 256, 5), (3, 1, 576), (16, 37, 100)]


def make(M, N, K, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEV)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(DEV)
    b = torch.randn(N, generator=g).to(dtype).to(DEV) if bias else None
    return x, w, b


def one_step(dtype):
    """Tolerance of one rounding step of `dtype` (relative), plus a float32-sized floor near zero."""
    return dict(atol=1e-5, rtol={torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype])


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_reference(M, N, K, bias, cfg):
    x, w, b = make(M, N, K, torch.float32, bias)
    out = gemv_triton(x, w, b, config=CONFIGS[cfg])
    assert out.shape == (M, N) and out.dtype == torch.float32
    torch.testing.assert_close(out, gemv_reference(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", ["default", "ew_split3", "dot_split2"])
@pytest.mark.parametrize("M,N,K", [(1, 37, 100), (3, 256, 576), (16, 37, 100)])
def test_half_within_one_step(M, N, K, dtype, cfg):
    x, w, b = make(M, N, K, dtype, bias=True, seed=1)
    out = gemv_triton(x, w, b, config=CONFIGS[cfg])
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), gemv_reference(x, w, b).float(), **one_step(dtype))


def test_strided_x_rows():
    """x may be a row-strided view (only its last dimension must be contiguous)."""
    x, w, b = make(4, 37, 100, torch.float32, bias=True)
    big = torch.zeros(4, 160, device=DEV)
    big[:, 30:130] = x
    xv = big[:, 30:130]
    torch.testing.assert_close(gemv_triton(xv, w, b), gemv_reference(x, w, b), atol=1e-5, rtol=1e-5)


def test_errors():
    x, w, _ = make(4, 8, 16, torch.float32, bias=False)
    with pytest.raises(ValueError, match="M"):
        gemv_triton(torch.zeros(17, 16, device=DEV), w)
    with pytest.raises(ValueError, match="K"):
        gemv_triton(x, torch.zeros(8, 15, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        gemv_triton(x, torch.zeros(16, 8, device=DEV).T)
    with pytest.raises(ValueError, match="contiguous"):
        gemv_triton(torch.zeros(16, 4, device=DEV).T, w)
    with pytest.raises(ValueError, match="dtype|float"):
        gemv_triton(x, w.to(torch.float16))
    with pytest.raises(ValueError, match="bias"):
        gemv_triton(x, w, torch.zeros(7, device=DEV))
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        gemv_triton(x[0], w)
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(BLOCK_N=24)


def test_default_config_deterministic_and_fills_h200():
    for M in (1, 2, 4, 16):
        for N, K in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
            c = default_config(M, N, K, torch.bfloat16)
            assert c == default_config(M, N, K, torch.bfloat16)
            programs = -(-N // c.BLOCK_N) * c.SPLIT_K
            assert programs >= 2 * 132, (M, N, K, c)
            assert c.BLOCK_N * c.BLOCK_K <= 8192


# ----------------------------------------------------------------------------------------------------------------------
# GPU only


@gpu
@pytest.mark.parametrize("M", [1, 2, 4, 16])
@pytest.mark.parametrize("N,K", [(4096, 14336), (28672, 4096), (6144, 4096)])
def test_llama8b_shapes_bf16(M, N, K):
    x, w, b = make(M, N, K, torch.bfloat16, bias=False, seed=2)
    out = gemv_triton(x, w)
    torch.testing.assert_close(out.float(), gemv_reference(x, w).float(), **one_step(torch.bfloat16))
    torch.testing.assert_close(out.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("M", [1, 4])
def test_cuda_graph_replay(M):
    x, w, b = make(M, 4096, 14336, torch.bfloat16, bias=True, seed=3)
    eager = gemv_triton(x, w, b)  # also compiles outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv_triton(x, w, b)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gemv_triton(x, w, b)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(torch.randn_like(x))  # new input, same buffers
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv_triton(x, w, b))
