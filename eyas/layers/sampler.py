"""Sampling on the device, with no host synchronisation and no generator state.

Randomness is a pure function of (request seed, position, stream index): `uniform(seed, counter, index)` hashes the
three with splitmix64. A request's draws therefore depend only on its own seed and positions, never on what else is
in the batch, and the same ops run inside a CUDA graph.

A step's new tokens (the first after a prompt, plain sampled decoding's, and the bonus after a speculative step's
accepted path) are drawn by an exponential race (`race_sample`): the token with the largest logit / t - log(E),
E ~ Exp(1) hashed per token, which is a draw of softmax(logits / t) in one pass over the logits, no normalised copy
and no cumulative sum (the filters' rows race among the tokens their filtered distribution keeps). The residuals of
the walk (`eyas.spec.verifier.accept_tree` without a race, and its reference) use the inverse CDF with one uniform:
the first token whose cumulative mass exceeds u * sum(p). Greedy rows (temperature 0) take the argmax (one-hot
distributions), so the same code serves them exactly.

Cumulative sums are taken in integers (`fixed_point_cumsum`): a float cumsum on CUDA is not reproducible bit for bit.
A one-row cumsum goes through CUB's decoupled look-back scan, whose float additions associate as the tiles happen to
finish, so two runs (or two tensor-parallel ranks, on identical logits) could put the CDF's crossing one token apart.
`eyas bench soak` at TP = 2 caught exactly that: after 74k steps the ranks sampled tokens 35821 and 35823. Integer
sums are the same in any order.
"""
from __future__ import annotations

import torch

_M64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as torch's signed int64."""
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def hash24(seeds: torch.Tensor, counters: torch.Tensor, index: torch.Tensor | int) -> torch.Tensor:
    """24 random bits (int64), one per broadcast element of (seeds, counters, index): what the uniforms and the
    race's exponentials are made of (`eyas.kernels.uniform.hash24` on the GPU)."""
    h = splitmix64(splitmix64(seeds.long()) ^ counters.long())
    # a Python int is added as a scalar (no host->device copy, so this runs inside CUDA graph capture)
    return _shr(splitmix64(h + (index if isinstance(index, int) else index.long())), 40)


def uniform(seeds: torch.Tensor, counters: torch.Tensor, index: torch.Tensor | int) -> torch.Tensor:
    """U[0, 1) float32, one per broadcast element of (seeds, counters, index); strictly inside (0, 1)."""
    return (hash24(seeds, counters, index).float() + 0.5) / float(1 << 24)


def tempered(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x = logits / t in float32 [R, V], greedy [R]: t <= 0, where x = logits) for logits [R, V], temperature [R]."""
    t = temperature.float()
    greedy = t <= 0
    return logits.float() / torch.where(greedy, torch.ones_like(t), t)[:, None], greedy


# The race's uniforms: token i of a draw at `index_base` takes index index_base + i, far above the acceptance rounds'
# indices (depth * (W + 1) + j) of the same (seed, counter).
RACE_BASE = 1 << 40


def race_exponentials(seeds: torch.Tensor, counters: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Exp(1) float32 draws, one per broadcast element of (seeds, counters, index): E = -log(1 - v), v = (k + 1) / 2^24
    for the same 24 hashed bits k as `uniform` (log1p: a small E, the likely winner of a race, keeps its precision;
    v <= 1 - 2^-24, so E is finite)."""
    v = (hash24(seeds, counters, index) + 1).clamp(max=(1 << 24) - 1).float() / float(1 << 24)
    return -torch.log1p(-v)


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                index_base: torch.Tensor, exclude: torch.Tensor | None = None,
                tau: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of softmax(logits / t), sampled by an exponential race: the token with the largest
    x_i - log(E_i) (x = logits / t, E_i ~ Exp(1) independent), i.e. the first to arrive when token i arrives at time
    E_i / p_i. P(i wins) = p_i exactly, with no sum over the vocabulary: the maximum of a row does not depend on the
    order of its comparisons, so every device, stream and rank gets the same token, and a GPU needs one pass over the
    row. Rows with t <= 0 take the argmax (the first maximum). logits [R, V]; temperature, seeds, counters,
    index_base [R] (token i draws at index_base + i); exclude [R, W] token ids never drawn (-1: none), the tokens a
    speculative step tried and rejected; tau [R]: only tokens with x >= tau take part (the filters' threshold,
    `filter_threshold`). `eyas.kernels.race.race_sample_triton` is the GPU's one pass."""
    x, greedy = tempered(logits, temperature)
    V = x.shape[-1]
    E = race_exponentials(seeds[:, None], counters[:, None], index_base[:, None] + torch.arange(V, device=x.device))
    score = torch.where(greedy[:, None], x, x - torch.log(E))
    if tau is not None:
        score = score.masked_fill(x < tau[:, None], float("-inf"))
    if exclude is not None:
        hit = torch.zeros(x.shape[0], V + 1, dtype=torch.bool, device=x.device)
        hit.scatter_(1, torch.where(exclude >= 0, exclude, V), True)
        score = score.masked_fill(hit[:, :V], float("-inf"))
    return score.argmax(-1)


def row_stats(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(M, Z, top) of each row of x = logits / t (t <= 0: t = 1): M = max x, Z = sum exp(x - M) (so softmax(x)_i =
    exp(x_i - M) / Z) and top = the argmax (its first maximum). logits [R, V], temperature [R]. What a sampled step's
    acceptance needs of the vocabulary at every node; `eyas.kernels.race.row_stats_triton` is the GPU's pass."""
    x, _ = tempered(logits, temperature)
    M = x.amax(-1)
    shift = torch.where(M == float("-inf"), torch.zeros_like(M), M)
    return M, torch.exp(x - shift[:, None]).sum(-1), logits.argmax(-1)


def filter_threshold(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filters (top-k, min-p, then top-p, as `logits_to_probs` orders them) as one threshold on x = logits / t:
    token i stays iff x_i >= tau. Returns (tau, M, Z, top) per row: M = max x, Z = sum of exp(x - M) over the
    tokens that stay (their softmax is exp(x - M) / Z), top the argmax. logits [R, V]; the settings [R].

    Order-independent rules (ties at a boundary all stay, where `logits_to_probs`' sort keeps some of them): top-k
    keeps i iff fewer than k tokens have a larger x; min-p iff x_i - M >= log(min_p); top-p keeps i iff the tokens
    still kept with a larger x hold less than top_p of their mass (the first token always stays; the masses in
    fixed point, so that the boundary does not depend on the order of a sum). Greedy rows (t <= 0): tau = M. The
    reference sorts; `eyas.kernels.filter_threshold` selects by radix instead."""
    x, greedy = tempered(logits, temperature)
    R, V = x.shape
    xs = x.sort(dim=-1, descending=True).values
    M = xs[:, 0]
    shift = torch.where(M == float("-inf"), torch.zeros_like(M), M)
    k = top_k.long()
    tau_k = torch.where((k > 0) & (k < V), xs.gather(1, (k.clamp(1, V) - 1)[:, None])[:, 0],
                        torch.full_like(M, float("-inf")))
    mp = min_p.float()
    tau_m = torch.where(mp > 0, M + torch.log(mp.clamp(min=1e-30)), torch.full_like(M, float("-inf")))
    tau = torch.maximum(tau_k, tau_m)
    # the masses in fixed point (exp(x - M) <= 1, times 2^32, floored: exact integers, summed in any order to the
    # same bits, as `fixed_point_cumsum`'s): a float sum's order would move the top-p boundary in a long tail
    e = torch.where(xs >= tau[:, None], torch.floor(torch.exp(xs - shift[:, None]) * float(1 << 32)), 0.0).long()
    Zk = e.sum(-1)
    # the mass of the kept tokens strictly larger than each: the exclusive cumsum at the start of its tie group
    before = e.cumsum(-1) - e
    pos = torch.arange(V, device=x.device).expand(R, V)
    new = torch.ones_like(xs, dtype=torch.bool)
    new[:, 1:] = xs[:, 1:] != xs[:, :-1]
    start = torch.where(new, pos, 0).cummax(-1).values
    above = before.gather(1, start)
    keep_p = (above.double() < top_p.double()[:, None] * Zk.double()[:, None]) | (top_p[:, None] >= 1.0)
    kept = (xs >= tau[:, None]) & keep_p
    kept[:, 0] = True
    tau = torch.where(kept, xs, float("inf")).amin(-1)
    tau = torch.where(greedy, M, tau)
    Z = torch.where(xs >= tau[:, None], torch.exp(xs - shift[:, None]), 0.0).sum(-1)
    return tau, M, Z, logits.argmax(-1)


def race_for(use_triton: bool):
    """`race_sample`, or on the Triton path its one-pass twin `eyas.kernels.race.race_sample_triton` (the same
    tokens): every race of a step, a prefill and an acceptance is chosen here."""
    if use_triton:
        from eyas.kernels.race import race_sample_triton
        return race_sample_triton
    return race_sample


def threshold_for(use_triton: bool):
    """`filter_threshold`, or on the Triton path its radix selection `eyas.kernels.filter_threshold` (no sort)."""
    if use_triton:
        from eyas.kernels.filter_threshold import filter_threshold_triton
        return filter_threshold_triton
    return filter_threshold


def logits_to_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None, filters: bool = True) -> torch.Tensor:
    """Target distribution after temperature, min-p, top-k and top-p (vLLM's order). logits [N, V]; per-row
    settings [N].

    Rows with temperature 0 give the one-hot of the argmax. top_k <= 0, top_p = 1 and min_p = 0 disable the filters.
    min-p keeps the tokens whose probability (after temperature) is at least min_p times the likeliest one's.
    `filters=False`: the caller knows that no row filters (`filters_of`), so the distribution is the softmax alone,
    without the sort over the vocabulary that the filters need (vLLM skips its top-k/top-p so); the general path
    with every filter off is its reference (equal up to the order of the softmax's additions).
    """
    x, greedy = tempered(logits, temperature)
    V = x.shape[-1]
    onehot = torch.zeros_like(x).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if not filters:
        return torch.where(greedy[:, None], onehot, torch.softmax(x, dim=-1))
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
    keep_sorted = ranks < k[:, None]
    if min_p is not None:  # p / p_max = exp(x - x_max) >= min_p, where min_p > 0
        mp = min_p.float()[:, None]
        keep_sorted &= ((sorted_x - sorted_x[:, :1]) >= torch.log(mp.clamp(min=1e-30))) | (mp <= 0)
    sorted_p = torch.softmax(sorted_x.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    fixed, cum = fixed_point_cumsum(sorted_p)
    mass_before = (cum - fixed).double()
    keep_sorted &= (mass_before < top_p[:, None].double() * cum[:, -1:].double()) | (top_p[:, None] >= 1.0)
    sorted_x = sorted_x.masked_fill(~keep_sorted, float("-inf"))
    probs = torch.zeros_like(x).scatter_(-1, order, torch.softmax(sorted_x, dim=-1))
    return torch.where(greedy[:, None], onehot, probs)


def filters_of(params) -> bool:
    """Whether any of these `SamplingParams` of sampled requests asks for top-k, top-p or min-p (a host-side flag
    for `logits_to_probs`; greedy requests filter nothing)."""
    return any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p in params)


FIXED_POINT_BITS = 32


def fixed_point_cumsum(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p [N, V] non-negative -> (q, cumsum of q), int64: q = floor(p / max(p) * 2^32) per row, the probabilities in
    fixed point relative to the row's largest one. Scaling by a power of two and flooring are exact in float32, and
    integer sums do not depend on the order of the additions, so every device, stream and rank gets the same bits.
    A token below 2^-32 of the row's top one is dropped (its probability < 2.4e-10, under what the uniforms'
    24 bits resolve)."""
    p = p.float()
    m = p.amax(-1, keepdim=True)
    q = torch.floor(p / torch.where(m > 0, m, torch.ones_like(m)) * float(1 << FIXED_POINT_BITS)).long()
    return q, q.cumsum(-1)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (unnormalised, non-negative), u [N] in (0, 1) -> token ids [N]: the first
    token whose cumulative mass exceeds u * total, on the integer CDF of `fixed_point_cumsum` (reproducible)."""
    _, cdf = fixed_point_cumsum(probs)
    target = (u.double() * cdf[:, -1].double()).long().unsqueeze(-1)  # in [0, total) since u < 1
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # a row of zeros (no mass at all): the most likely token, i.e. token 0
    return torch.where(idx >= probs.shape[-1], probs.argmax(-1), idx)


SAMPLING_MODES = ("greedy", "sampled", "filtered")


def sampling_mode(params) -> str:
    """How a step of requests with these `SamplingParams` samples (CUDA graphs are captured per mode): "greedy"
    (every request at temperature 0: acceptance needs only the argmax), "filtered" (a sampled request asks for
    top-k, top-p or min-p: the sampler sorts the vocabulary), else "sampled" (a softmax, `logits_to_probs`'s
    `filters=False`)."""
    if all(p.temperature == 0.0 for p in params):
        return "greedy"
    return "filtered" if filters_of(params) else "sampled"
