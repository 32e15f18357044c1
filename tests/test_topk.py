"""The two-pass top-k of the draft's candidates (`eyas.layers.topk`) against torch.topk over the whole row, and its
Triton kernel (`eyas.kernels.chunk_topk`, under the interpreter on the CPU) against a stable sort."""
import os

import torch

if not torch.cuda.is_available():  # before Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import example, given, settings
from hypothesis import strategies as st

from eyas.layers.topk import argmax, chunk_size, topk_indices  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([128, 1000, 4096, 49152, 128256]), st.integers(1, 3), st.integers(2, 16), st.integers(0, 10**6))
def test_equals_torch_topk_without_ties(V, rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randperm(V, generator=g)[None].repeat(rows, 1).float()  # distinct values: one right answer
    for r in range(rows):
        x[r] = x[r][torch.randperm(V, generator=g)]
    # adversarial: the whole top k inside one chunk (the first pass must keep k per chunk, not fewer)
    x[0, :k] = V + torch.arange(k, dtype=torch.float32)
    got = topk_indices(x.view(rows, 1, V), k).view(rows, k)
    assert torch.equal(got, x.topk(k, dim=-1).indices)


def test_ties_keep_the_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (4, 49152), generator=g).float()  # massive ties
    got = topk_indices(x, 10)
    assert torch.equal(x.gather(-1, got), x.topk(10, dim=-1).values)
    assert all(len(set(r.tolist())) == 10 for r in got)  # distinct ids


def test_chunking_is_used_where_it_pays():
    assert chunk_size(49152, 10) == 2048 and chunk_size(128256, 4) == 256 and chunk_size(16384, 8) == 2048
    assert chunk_size(1000, 4) is None and chunk_size(2048, 4) == 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_bf16():
    x = torch.randn(26, 49152, device="cuda").bfloat16().float()
    x += torch.arange(49152, device="cuda") * 1e-6  # break bf16 ties
    assert torch.equal(topk_indices(x, 10), x.topk(10, dim=-1).indices)


def _stable_topk(x, k):
    """The k largest, lower index first among equal values: a stable descending sort (an oracle with ties too)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([16, 1000, 2048, 4097, 49152]), st.integers(1, 3), st.integers(1, 16), st.booleans(),
       st.integers(0, 10**6))
def test_triton_topk_equals_a_stable_sort(V, rows, k, ties, seed):
    """The Triton kernel's indices are the stable sort's first k, also with ties (few distinct values), also with
    the whole top k inside one chunk, across chunk edges (4097) and in bf16."""
    from eyas.kernels.chunk_topk import topk_indices_triton
    k = min(k, V)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 5, (rows, V), generator=g).float() if ties else torch.randn(rows, V, generator=g)
    x[0, V - k:] = 100 + torch.arange(k, dtype=torch.float32)  # the top k at the row's end, in one chunk
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = topk_indices_triton(xd.view(rows, 1, V).to(DEV), k).cpu()
        assert got.shape == (rows, 1, k) and got.dtype == torch.long
        assert torch.equal(got.view(rows, k), _stable_topk(xd.float(), k))


def test_argmax_is_the_first_maximum():
    x = torch.tensor([[1.0, 7.0, 3.0, 7.0], [-5.0, -5.0, -6.0, -9.0]]).to(DEV)
    assert argmax(x).tolist() == [1, 0] == x.argmax(-1).tolist()
    wide = torch.randn(3, 5000).to(DEV)
    wide[1, 4999] = wide[1, 17] = 50.0
    assert torch.equal(argmax(wide), wide.argmax(-1)) and argmax(wide)[1].item() == 17


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([16, 1000, 4097, 6144]), st.integers(1, 3), st.integers(1, 16), st.booleans(),
       st.integers(0, 10**6))
@example(V=4097, rows=2, k=5, masked=True, seed=0)  # a whole chunk of -inf, always: the draws may miss one
@example(V=6144, rows=1, k=16, masked=True, seed=1)
def test_triton_topk_logp_equals_log_softmax(V, rows, k, masked, seed):
    """The fused top-k with log-probabilities (a dynamic tree's scores): the indices are the stable sort's first k
    and the values log_softmax's there, in float32 and bf16, also where whole chunks are -inf (a masked vocabulary)
    and the top k sit in one chunk at the row's end. The PyTorch reference (`topk_logp_torch`, CPU) is held to the
    same, where ties may come in another order (`topk_indices`)."""
    from eyas.kernels.chunk_topk import topk_logp_triton
    from eyas.layers.topk import topk_logp_torch
    k = min(k, V)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g) * 4
    if masked:
        x[:, : V // 2] = float("-inf")
    x[0, V - k:] = 10 + torch.arange(k, dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        want_i = _stable_topk(xd.float(), k)
        want_v = torch.log_softmax(xd.float(), dim=-1).gather(-1, want_i)
        for fn, dev in ((topk_logp_triton, DEV), (topk_logp_torch, "cpu")):
            v, i = fn(xd.view(rows, 1, V).to(dev), k)
            assert i.shape == v.shape == (rows, 1, k) and v.dtype == torch.float32
            i = i.cpu().view(rows, k)
            assert torch.equal(i, want_i) if fn is topk_logp_triton else torch.equal(xd.gather(-1, i),
                                                                                      xd.gather(-1, want_i))
            torch.testing.assert_close(v.cpu().view(rows, k), want_v.clamp(max=0.0), atol=1e-5, rtol=1e-5)


def test_topk_kernels_with_pdl_compile_for_sm90():
    """`eyas.kernels.chunk_topk.PDL`'s variants of both passes (on by default since session 40) compile for
    sm_90 (offline), each program letting the next kernel in and then waiting before it reads (PTX order)."""
    pytest.importorskip("triton.compiler")
    from helpers import compile_for_sm90
    sig = {"X": "*bf16", "VOUT": "*fp32", "IOUT": "*i32", "STATS": "*fp32", "V": "i32", "n_chunks": "i32",
           "stride_xr": "i32", "K": "constexpr", "BLOCK": "constexpr", "LSE": "constexpr", "USE_GDC": "constexpr"}
    merge = {"VIN": "*fp32", "IIN": "*i32", "OUT": "*i64", "STATS": "*fp32", "LOGP": "*fp32", "n_cand": "i32",
             "n_chunks": "i32", "K": "constexpr", "BLOCK": "constexpr", "LSE": "constexpr", "BLOCK_C": "constexpr",
             "USE_GDC": "constexpr"}
    results = compile_for_sm90([
        ("eyas.kernels.chunk_topk", "_chunk_topk_kernel", sig, dict(K=8, BLOCK=2048, LSE=True, USE_GDC=True),
         {"num_warps": 4}),
        ("eyas.kernels.chunk_topk", "_merge_topk_kernel", merge,
         dict(K=8, BLOCK=256, LSE=True, BLOCK_C=32, USE_GDC=True), {"num_warps": 4})])
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["gdc"] == ["launch_dependents", "wait"]


def test_the_draft_levels_small_kernels_ask_pdl_only_where_the_gpu_has_it(monkeypatch):
    """`eyas.kernels.interpret.pdl_on`, which the top-k passes, `draft_pairs` and the step prologue launch through:
    with their switch on they take PDL on an sm_90 GPU, never on an older one (the launch attribute and the
    griddepcontrol instructions are Hopper's), the CPU, or under the interpreter."""
    import eyas.kernels.chunk_topk as ct
    import eyas.kernels.draft_pairs as dp
    import eyas.kernels.spec_prologue as sp
    from eyas.kernels import interpret
    from eyas.models import one_row
    from eyas.spec.tree import resolve_tree
    asked = []
    for mod in (ct, dp, sp):  # each launch asks with its own switch and its tensors' device
        monkeypatch.setattr(mod, "pdl_on", lambda switch, device, _m=mod.__name__: asked.append((_m, switch)) or
                            (False, {}))
    x = torch.randn(2, 300, device=DEV)
    ct.topk_indices_triton(x, 2)
    dp.draft_pairs_triton(torch.randn(10, 4, device=DEV), torch.tensor([[1, 2]], device=DEV),
                          feats=torch.randn(1, 2, 4, device=DEV))
    z = torch.ones(1, dtype=torch.long, device=DEV)
    sp.step_indices_triton(z, z, z, resolve_tree("chain:3").depth.to(DEV), 4)
    assert {m for m, switch in asked} == {ct.__name__, dp.__name__, sp.__name__}
    assert all(switch for m, switch in asked)  # all three switches are on by default
    monkeypatch.setattr(interpret, "interpreting", lambda: False)  # what a GPU's launch sees
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(one_row, "_pdl", lambda index: False)  # an A100
    assert interpret.pdl_on(True, cuda) == (False, {})
    monkeypatch.setattr(one_row, "_pdl", lambda index: True)  # an H200
    assert interpret.pdl_on(True, cuda) == (True, {"launch_pdl": True})
    assert interpret.pdl_on(False, cuda) == (False, {})
    assert interpret.pdl_on(True, torch.device("cpu")) == (False, {})
