"""The sampler's counter-based uniforms in one Triton launch: `eyas.layers.sampler.uniform` (its reference) for CUDA.

The reference hashes (seed, counter, index) with three rounds of splitmix64 in int64 PyTorch ops: ~45 elementwise
kernels, each a launch of its own inside a step's CUDA graph, for a few dozen numbers. A sampled step draws all its
uniforms at once (`eyas.spec.verifier.accept_tree`), so here one launch computes the same bits: the hash in uint64
(wrapping multiplies, logical shifts), its top 24 bits to float32 as the reference does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _splitmix64(x):
    z = x + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def hash24(SEEDS, CNT, b, index):
    """The 24 random bits (uint64) of (seed, counter) of row b and int64 `index` (any shape), as
    `eyas.layers.sampler.hash24`: what the uniforms, the race's exponentials and the acceptance rounds draw from."""
    seed = tl.load(SEEDS + b).to(tl.int64).to(tl.uint64, bitcast=True)
    cnt = tl.load(CNT + b).to(tl.int64).to(tl.uint64, bitcast=True)
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ cnt) + index.to(tl.uint64, bitcast=True)) >> 40


@triton.jit
def _uniform_kernel(SEEDS, CNT, INDEX, OUT, m, stride_ib, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < m
    idx = tl.load(INDEX + b * stride_ib + offs, mask=ok, other=0).to(tl.int64)
    bits = hash24(SEEDS, CNT, b, idx).to(tl.float32)
    tl.store(OUT + b * m + offs, (bits + 0.5) / 16777216.0, mask=ok)


def uniform_triton(seeds: torch.Tensor, counters: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`uniform(seeds[:, None], counters[:, None], index)` for seeds, counters [B] and index [B, M] (or [M], the
    same for every row): U[0, 1) float32 [B, M], the reference's bits."""
    B = seeds.shape[0]
    if index.dim() == 1:
        index = index[None].expand(B, -1)
    M = index.shape[1]
    if index.stride(1) != 1:
        index = index.contiguous()
    out = torch.empty(B, M, dtype=torch.float32, device=seeds.device)
    if B and M:
        BLOCK = min(1024, triton.next_power_of_2(M))
        _uniform_kernel[(B, triton.cdiv(M, BLOCK))](seeds, counters, index, out, M, index.stride(0), BLOCK=BLOCK)
    return out
