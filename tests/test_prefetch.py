"""The L2 prefetch that plain decoding's prefix attention issues for the o projection's weight
(`eyas.kernels.prefetch`, `eyas.models.llama.PREFETCH_O_BYTES`), and the verify passes' and draft levels'
split tree attention the same way.

A prefetch changes no value, so the GPU tests hold outputs with it bitwise equal to outputs without it; the offline
sm_90 compile checks that the instructions are there (and before the PDL wait), which no output can show. Under the
Triton interpreter (CPU) the prefetch is skipped:

    .venv/bin/python -m pytest -q tests/test_prefetch.py
"""
import os

import torch

if not torch.cuda.is_available():  # before Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from eyas.kernels.prefetch import LINE, lines_per_program, prefetch_lines  # noqa: E402
from eyas.models import llama, one_row  # noqa: E402

DEV = "cpu" if INTERPRET else "cuda"
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                         reason="needs CUDA and compiled (not interpreted) Triton kernels")


@pytest.mark.parametrize("nbytes,programs", [(1, 1), (LINE, 1), (LINE + 1, 1), (33_554_432, 144), (33_554_432, 7),
                                             (1_327_104, 24), (10 * LINE, 3)])
def test_lines_per_program_cover_every_byte_in_a_power_of_two(nbytes, programs):
    lines = lines_per_program(nbytes, programs)
    assert lines & (lines - 1) == 0
    assert lines * programs * LINE >= nbytes
    assert lines == 1 or (lines // 2) * programs * LINE < nbytes   # the smallest such power of two


def test_no_prefetch_without_a_cuda_tensor_or_under_the_interpreter():
    assert prefetch_lines(None, 8) == (None, 0, 0)
    assert prefetch_lines(torch.zeros(4, 4), 8) == (None, 0, 0)        # a CPU tensor (also what the interpreter has)


def test_o_prefetch_takes_wide_weights_only(monkeypatch):
    wide = nn.Linear(2048, 2048, bias=False, device="meta", dtype=torch.bfloat16)      # 8 MiB: the line
    narrow = nn.Linear(2048, 2046, bias=False, device="meta", dtype=torch.bfloat16)    # just under it
    assert llama.o_prefetch(wide) is wide.weight
    assert llama.o_prefetch(narrow) is None
    monkeypatch.setattr(llama, "PREFETCH_O_BYTES", 0)
    assert llama.o_prefetch(wide) is None


def test_prefetch_variant_compiles_for_sm90_with_its_prefetches_before_the_wait():
    """The prefix kernel as plain decoding launches it at the 8B shape with PDL and a prefetch of 2,048 lines a
    program (the o weight over 144 programs), compiled offline: every program's lines become `prefetch.global.L2`
    instructions ahead of its `griddepcontrol.wait` (16 a thread at 4 warps); without the prefetch there is none."""
    import inspect

    from helpers import compile_for_sm90

    from eyas.kernels.tree_attention import _paged_prefix_kernel
    names = list(inspect.signature(_paged_prefix_kernel.fn).parameters)
    consts = dict(G=4, HEAD_D=128, BLOCK_D=128, PAGE=16, BLOCK_M=16, BLOCK_N=64, DOT_PREC="tf32", UPCAST=False,
                  USE_GDC=True, SKIP_EMPTY=False, PF_END=False)
    ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", BT="*i32", CL="*i64", O="*fp32", LSE="*fp32", PF="*u8")
    floats = {"qk_scale": "fp32"}

    def variant(lines):
        c = dict(consts, PF_LINES=lines)
        sig = {n: ("constexpr" if n in c else ptrs.get(n) or floats.get(n) or ("i64" if n == "pf_bytes" else "i32"))
               for n in names}
        return ("eyas.kernels.tree_attention", "_paged_prefix_kernel", sig, c, {"num_warps": 4, "num_stages": 2})
    with_pf, without = compile_for_sm90([variant(2048), variant(0)])
    assert with_pf["error"] is None and without["error"] is None, (with_pf["error"], without["error"])
    assert with_pf["prefetches"] == with_pf["prefetches_before_wait"] == 16
    assert without["prefetches"] == 0


@gpu
@pytest.mark.parametrize("B,H,KVH,D,ctx", [(1, 32, 8, 128, 1100), (1, 9, 3, 64, 300), (3, 8, 2, 64, 777)])
def test_gpu_prefix_attention_with_a_prefetch_is_bitwise_the_same(B, H, KVH, D, ctx):
    from eyas.kernels import paged_prefix_attention
    g = torch.Generator(device="cuda").manual_seed(0)
    page = 16
    blocks = B * (-(-ctx // page)) + 1
    kc = torch.randn(blocks, page, KVH, D, generator=g, device="cuda").bfloat16()
    vc = torch.randn(blocks, page, KVH, D, generator=g, device="cuda").bfloat16()
    bt = (torch.randperm(blocks - 1, generator=g, device="cuda") + 1).view(B, -1).to(torch.int32)
    cl = torch.full((B,), ctx, device="cuda")
    q = torch.randn(B, 1, H, D, generator=g, device="cuda").bfloat16()
    weight = torch.randn(4096, 4096, generator=g, device="cuda").bfloat16()
    for pdl in (False, True):
        want = paged_prefix_attention(q, kc, vc, bt, cl, 0.1, out_dtype=torch.bfloat16, pdl=pdl)
        got = paged_prefix_attention(q, kc, vc, bt, cl, 0.1, out_dtype=torch.bfloat16, pdl=pdl, prefetch=weight)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the verify passes' split tree attention: 4 tree tokens under a causal mask
    from eyas.kernels import split_tree_attention_triton
    qt = torch.randn(B, 4, H, D, generator=g, device="cuda").bfloat16()
    kn = torch.randn(B, 4, KVH, D, generator=g, device="cuda").bfloat16()
    vn = torch.randn(B, 4, KVH, D, generator=g, device="cuda").bfloat16()
    mask = torch.ones(4, 4, dtype=torch.bool, device="cuda").tril().expand(B, 4, 4).contiguous()
    for pdl in (False, True):
        want = split_tree_attention_triton(qt, kn, vn, kc, vc, bt, cl, mask, 0.1, out_dtype=torch.bfloat16, pdl=pdl)
        got = split_tree_attention_triton(qt, kn, vn, kc, vc, bt, cl, mask, 0.1, out_dtype=torch.bfloat16, pdl=pdl,
                                          prefetch=weight)
        assert torch.equal(got, want)


@gpu
@pytest.mark.parametrize("spec", [None, "chain:3"])
def test_gpu_decoding_with_the_prefetch_gives_the_same_tokens(tmp_path, monkeypatch, spec):
    """A 2048-wide random model (its o weight 8 MiB, at PREFETCH_O_BYTES) decoding at batch 1 under CUDA graphs:
    plain (the one-row path) or `chain:3` with a random draft of its width (verify passes on the fused path): the
    same greedy tokens with the prefetch as without it, and the prefetch was asked for."""
    from eyas import LLM, SamplingParams
    from eyas.layers import attention
    from helpers import write_random_draft, write_tiny_llama
    target = write_tiny_llama(tmp_path / "t", vocab=64, hidden=2048, heads=16, kv_heads=4, layers=2)
    kw = dict(draft=str(write_random_draft(tmp_path / "d", target, layers=1, scale=0.3)), speculation=spec) if spec \
        else {}
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    asked = []

    def spy(real):
        def f(*a, **k):
            asked.append(k.get("prefetch") is not None)
            return real(*a, **k)
        return f
    monkeypatch.setattr(one_row, "prefix_only_attention", spy(attention.prefix_only_attention))
    monkeypatch.setattr(llama, "split_tree_attention", spy(attention.split_tree_attention))

    def run(nbytes):
        monkeypatch.setattr(llama, "PREFETCH_O_BYTES", nbytes)
        llm = LLM(str(target), device="cuda", dtype="bfloat16", cuda_graphs=True, **kw)
        return [llm.generate([p], params)[0].token_ids for p in ([1, 2, 3], [5, 8, 13, 21])]  # batch 1 each
    off = run(0)
    assert asked and not any(asked)
    asked.clear()
    on = run(8 << 20)
    assert any(asked)
    assert on == off
