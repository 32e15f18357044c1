"""The o projection of a wide model's verify pass on decode_linear's tile kernel (`eyas.models.llama.add_o_proj_`,
`O_TILE_ROWS`) against cuBLAS's in-GEMM add (`add_linear_`) it replaces, and the rule that picks it.

Without CUDA the kernel runs under the Triton interpreter (CPU). On a GPU machine the `gpu` tests run the compiled
kernel at the 8B shape's o projection and a wide tiny model's speculative decoding under CUDA graphs:

    .venv/bin/python -m pytest -q tests/test_o_tile.py
"""
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # before Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

import pytest  # noqa: E402
from torch import nn  # noqa: E402

import eyas.kernels.decode_linear as dl  # noqa: E402
from eyas.models import llama  # noqa: E402
from eyas.models.one_row import FEW_ROWS_MAX_HIDDEN  # noqa: E402

DEV = "cpu" if INTERPRET else "cuda"
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                         reason="needs CUDA and compiled (not interpreted) Triton kernels")
VERIFY = SimpleNamespace(use_triton=True, prefix_includes_new=False)   # what takes_o_tile reads of the metadata
H_WIDE = FEW_ROWS_MAX_HIDDEN + 64                                       # K = 1088: 4 full k-steps of 256, a masked one


def _case(M, H=H_WIDE, dtype=torch.bfloat16, seed=0):
    """(residual [M, H], x [M, H], an o projection H -> H), random."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    o = nn.Linear(H, H, bias=False, device=DEV, dtype=dtype).requires_grad_(False)
    o.weight.copy_(torch.randn(H, H, generator=g, device=DEV) * H ** -0.5)
    x = torch.randn(M, H, generator=g, device=DEV).to(dtype)
    residual = torch.randn(M, H, generator=g, device=DEV).to(dtype)
    return residual, x, o


@pytest.fixture
def calls(monkeypatch):
    """The configs of decode_linear's launches (add_o_proj_ is its only caller in the function-level tests)."""
    seen = []
    real = dl.decode_linear

    def spy(*a, **kw):
        seen.append(kw.get("config"))
        return real(*a, **kw)
    monkeypatch.setattr(dl, "decode_linear", spy)
    return seen


@pytest.fixture
def taken(monkeypatch):
    """takes_o_tile's answers, in the order add_o_proj_ asked."""
    seen = []
    real = llama.takes_o_tile

    def spy(*a):
        seen.append(real(*a))
        return seen[-1]
    monkeypatch.setattr(llama, "takes_o_tile", spy)
    return seen


@pytest.mark.parametrize("M", [8, 12, 16])
def test_o_tile_equals_the_in_gemm_add(M, calls, taken):
    """8-16 rows (O_TILE_MIN_ROWS to O_TILE_ROWS) of a model wider than FEW_ROWS_MAX_HIDDEN, bf16: one tile launch
    at O_TILE_CONFIG, writing into the residual stream in place, within bf16 rounding of residual + x @ W^T through
    cuBLAS's beta = 1 (the tile rounds the product before the add, the GEMM after it)."""
    residual, x, o = _case(M)
    want = llama.add_linear_(residual.clone(), x, o)
    out = llama.add_o_proj_(residual, x, o, VERIFY)
    assert out is residual and taken == [True] and calls == [dl.TileConfig(*llama.O_TILE_CONFIG)]
    torch.testing.assert_close(residual.float(), want.float(), atol=4e-2, rtol=2e-2)


def test_o_tile_reference_is_not_the_residual():
    """The comparison above can fail: the product without the residual, or the residual alone, is far off."""
    residual, x, o = _case(8)
    want = llama.add_linear_(residual.clone(), x, o)
    assert not torch.allclose(residual.float(), want.float(), atol=4e-2, rtol=2e-2)
    assert not torch.allclose(o(x).float(), want.float(), atol=4e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["one row", "4 rows", "7 rows", "17 rows", "plain decode step", "no triton",
                                  "no metadata", "off", "narrow", "float32", "bias", "hooked",
                                  "non-contiguous residual"])
def test_o_tile_rule_leaves_the_rest_to_cublas(case, calls, taken, monkeypatch):
    """What does not take the tile: one row (the one-row path's), fewer than O_TILE_MIN_ROWS (4: batch 1's `chain:3`,
    where cuBLAS was faster) or more than O_TILE_ROWS, a plain decoding step, a pass without Triton or metadata,
    O_TILE_ROWS = 0, a model no wider than FEW_ROWS_MAX_HIDDEN (its verify passes take the few-rows path), float32,
    a projection with a bias or a hook (tensor parallelism all-reduces there), a residual that is a strided view.
    Each still gives residual + o(x)."""
    M = {"one row": 1, "4 rows": 4, "7 rows": 7, "17 rows": 17}.get(case, 8)
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    residual, x, o = _case(M, H=FEW_ROWS_MAX_HIDDEN if case == "narrow" else H_WIDE, dtype=dtype)
    meta = {"plain decode step": SimpleNamespace(use_triton=True, prefix_includes_new=True),
            "no triton": SimpleNamespace(use_triton=False, prefix_includes_new=False),
            "no metadata": None}.get(case, VERIFY)
    if case == "off":
        monkeypatch.setattr(llama, "O_TILE_ROWS", 0)
    if case == "bias":
        o.bias = nn.Parameter(torch.ones(o.out_features, device=DEV, dtype=dtype), requires_grad=False)
    if case == "hooked":
        o.register_forward_hook(lambda mod, inp, out: out * 2)
    if case == "non-contiguous residual":
        residual = torch.cat([residual, residual], dim=1)[:, ::2]
    want = residual.float() + o(x).float()
    llama.add_o_proj_(residual, x, o, meta)
    assert taken == [False] and calls == []
    torch.testing.assert_close(residual.float(), want, atol=4e-2, rtol=2e-2)


@gpu
def test_gpu_o_tile_at_the_8b_shape(calls):
    """The compiled kernel (PDL on sm_90) at the 8B shape's o projection (4096 x 4096), 8 rows: within bf16 rounding
    of cuBLAS's in-GEMM add."""
    residual, x, o = _case(8, H=4096)
    want = llama.add_linear_(residual.clone(), x, o)
    llama.add_o_proj_(residual, x, o, VERIFY)
    assert len(calls) == 1
    torch.testing.assert_close(residual.float(), want.float(), atol=4e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("spec,prompts", [("chain:3", [[1, 2, 3], [5, 8, 13, 21]]), ("tree:8", [[5, 8, 13, 21]])])
def test_gpu_wide_model_speculates_on_the_o_tile_under_graphs(tmp_path, spec, prompts, taken, monkeypatch):
    """A 1152-wide random model in bf16 under CUDA graphs: its verify passes (chain:3 at batch 2: 8 rows; tree:8 at
    batch 1: 9) take the o tile, and the greedy tokens are those with O_TILE_ROWS = 0 (cuBLAS) over 12 tokens."""
    from eyas import LLM, SamplingParams
    from helpers import write_random_draft, write_tiny_llama
    target = write_tiny_llama(tmp_path / "t", vocab=64, hidden=1152, heads=9, kv_heads=3, layers=2)
    draft = write_random_draft(tmp_path / "d", target, layers=1, scale=0.3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def run(rows):
        monkeypatch.setattr(llama, "O_TILE_ROWS", rows)
        llm = LLM(str(target), device="cuda", dtype="bfloat16", cuda_graphs=True, draft=str(draft),
                  speculation=spec)
        return [o.token_ids for o in llm.generate(prompts, params)]
    off = run(0)
    assert taken and not any(taken)
    taken.clear()
    on = run(16)
    assert any(taken)
    assert on == off
