"""Log-probabilities of the output tokens (`SamplingParams.logprobs`), as OpenAI's API reports them: each token's
log-probability under the target, and the k likeliest tokens in its place with theirs.

They are the target's own: log-softmax of its logits before temperature, top-k and top-p (vLLM's default, its
"raw" logprobs), so they do not depend on how a token was chosen. With speculation, the token at depth j of the
accepted path was verified against the logits of the path's node at depth j - 1, which are the same logits plain
decoding would compute for it: a speculative step's log-probabilities equal plain decoding's. Under guided decoding
the logits are the grammar-masked ones the step verified against (forbidden tokens at -inf)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """One output token's entry: its log-probability and the k likeliest (token id, log-probability), best first;
    a prompt token's also its rank (1: the likeliest; vLLM's `prompt_logprobs` report it)."""
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """logits [..., V], tokens [...] -> (the tokens' log-probabilities [...], the top k's [..., k] and their ids
    [..., k]), in float32."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[..., :0], tokens.new_zeros(tokens.shape + (0,)))
    return chosen, top_lp, top_ids


def token_ranks(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [..., V], tokens [...] -> each token's rank [...] among its row's logits (1: the likeliest; ties
    count for the token, as vLLM counts them)."""
    chosen = logits.gather(-1, tokens.long().unsqueeze(-1))
    return (logits > chosen).sum(-1) + 1


def entries(chosen: torch.Tensor, top_lp: torch.Tensor, top_ids: torch.Tensor, n: int,
            ranks: torch.Tensor | None = None) -> list[TokenLogprobs]:
    """The first n entries of one sequence's rows (host tensors [P], [P, k], [P, k], and ranks [P])."""
    c, tl, ti = chosen[:n].tolist(), top_lp[:n].tolist(), top_ids[:n].tolist()
    r = ranks[:n].tolist() if ranks is not None else [None] * n
    return [TokenLogprobs(c[j], list(zip(ti[j], tl[j])), r[j]) for j in range(n)]
