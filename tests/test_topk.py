"""The two-pass top-k of the draft's candidates (`eyas.layers.topk`) against torch.topk over the whole row."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.layers.topk import chunk_size, topk_indices


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
