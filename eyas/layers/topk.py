"""Top-k indices over a wide vocabulary in few kernels (the draft's candidates at every tree level).

On CUDA, `torch.topk` over one 49k-wide row takes PyTorch's multi-block radix select: about 20 small kernels per call,
and a speculative step on a deep tree calls it at every level (~90 kernels of a 727-kernel `mc_sim_7b_63` step on the
H200, where each kernel costs ~3 us in a launch-bound step). Two passes over chunks are exact and take ~5: the top k
of every chunk of C logits (many short rows: PyTorch's single-block select), then the top k of those candidates.
The true top k are among the chunk winners, since each is in the top k of its own chunk.

`topk_indices` equals `torch.topk(x, k).indices` (sorted, largest first) whenever no two of the top values tie; with
ties the set of values is the same (`tests/test_topk.py` holds both).
"""
from __future__ import annotations

import functools

import torch

MAX_K = 16  # the most k the two-pass top-k (and its Triton kernel) takes; beyond it torch.topk is as good


def chunk_size(V: int, k: int) -> int | None:
    """The largest power of two C in [max(k, 64), 2048] that divides V into at least 2 chunks, or None."""
    C = 2048
    while C >= max(k, 64):
        if V % C == 0 and V // C >= 2:
            return C
        C //= 2
    return None


@functools.cache
def _chunk_starts(V: int, C: int, device: str) -> torch.Tensor:
    """[V // C, 1]: each chunk's first index, made once per (V, C, device) (a CUDA graph's eager warm-up makes it)."""
    return torch.arange(0, V, C, device=device)[:, None]


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the k largest entries of x [..., V] along the last dimension, largest first. On CUDA the
    two Triton launches of `eyas.kernels.chunk_topk` (lower index first among ties); elsewhere, and as their
    reference, the chunked `torch.topk` below."""
    V = x.shape[-1]
    if x.is_cuda and k <= MAX_K and V >= k:
        from eyas.kernels.chunk_topk import topk_indices_triton
        return topk_indices_triton(x, k)
    return topk_indices_torch(x, k)


def topk_logp(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [..., k] in float32, indices [..., k]) of the k largest entries of logits x [..., V]: the
    values of `log_softmax(x.float())` at `topk_indices(x, k)`, clamped to <= 0. On CUDA the same two Triton launches
    as `topk_indices`, which also merge the row's log-sum-exp; elsewhere, and as their reference, `topk_logp_torch`."""
    V = x.shape[-1]
    if x.is_cuda and k <= MAX_K and V >= k:
        from eyas.kernels.chunk_topk import topk_logp_triton
        return topk_logp_triton(x, k)
    return topk_logp_torch(x, k)


def topk_logp_torch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_logp` in PyTorch."""
    idx = topk_indices_torch(x, k)
    val = x.gather(-1, idx).float() - torch.logsumexp(x.float(), dim=-1, keepdim=True)
    return val.clamp(max=0.0), idx


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> the index of the first maximum along the last dimension (as `x.argmax(-1)`). On CUDA the Triton
    top-1 (~2 short launches, where one 49k-wide row is ~13 us in PyTorch's single-block reduction)."""
    if x.is_cuda:
        from eyas.kernels.chunk_topk import topk_indices_triton
        return topk_indices_triton(x, 1)[..., 0]
    return x.argmax(-1)


def topk_indices_torch(x: torch.Tensor, k: int) -> torch.Tensor:
    """`topk_indices` in PyTorch: the top k of every chunk, then the top k of those (exact; ~5 kernels on CUDA
    where `torch.topk` over one wide row takes ~20)."""
    V = x.shape[-1]
    C = chunk_size(V, k) if k <= MAX_K else None
    if C is None:
        return x.topk(k, dim=-1).indices
    lead = x.shape[:-1]
    n = V // C
    v1, i1 = x.reshape(-1, n, C).topk(k, dim=-1, sorted=False)  # [R, n, k] each chunk's winners
    i1 = i1 + _chunk_starts(V, C, str(x.device))  # ids in the whole row
    j = v1.reshape(-1, n * k).topk(k, dim=-1).indices  # [R, k] the winners among the winners, sorted
    return i1.reshape(-1, n * k).gather(-1, j).reshape(*lead, k)
