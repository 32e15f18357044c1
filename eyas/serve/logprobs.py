"""The `logprobs` of OpenAI's responses, from the engine's `TokenLogprobs` (eyas.layers.logprobs).

* /v1/completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; each position's
  `top_logprobs` maps the k likeliest tokens' texts, and the chosen token's, to their log-probabilities (vLLM's
  shape); `text_offset` counts characters of the tokens' texts from the start of the completion. With `echo`, the
  prompt's tokens come first (`SamplingParams.prompt_logprobs`), the first with null log-probabilities.
* /v1/chat/completions (`logprobs: true`, `top_logprobs: k`): {"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}.
A token's text is its own decoding (a token that holds part of a UTF-8 character decodes to U+FFFD, and its `bytes`
are those of that text); a model without a tokenizer names tokens "token_id:<id>" (vLLM's spelling).

A token the step had ruled out (guided decoding's mask, min_tokens' ban: its logit -inf) is reported at -9999.0, as
vLLM does: JSON has no infinity (Python would write `-Infinity`, which strict parsers refuse)."""
from __future__ import annotations

from collections.abc import Callable

FLOOR = -9999.0  # what a log-probability of -inf is reported as (vLLM's value)


def _finite(lp: float) -> float:
    return lp if lp >= FLOOR else FLOOR  # -inf (and anything below the floor) -> the floor


def completion_logprobs(entries: list, token_ids: list[int], text_of: Callable[[int], str], offset: int = 0) -> dict:
    tokens, chosen, tops, offsets = [], [], [], []
    for t, e in zip(token_ids, entries):
        s = text_of(t)
        tokens.append(s)
        if e is None:  # an echoed prompt's first token: nothing before it to condition on (null, as in vLLM)
            chosen.append(None)
            tops.append(None)
        else:
            chosen.append(_finite(e.logprob))
            top = {text_of(i): _finite(lp) for i, lp in e.top}
            top.setdefault(s, _finite(e.logprob))
            tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(entries: list, token_ids: list[int], text_of: Callable[[int], str]) -> list:
    """vLLM's `prompt_logprobs` field: per prompt token, None for the first, then {token id (a string, as JSON keys
    are): {"logprob", "rank", "decoded_token"}} for the token itself and the k likeliest in its place."""
    out = [None]
    for t, e in zip(token_ids[1:], entries):
        d = {str(i): {"logprob": _finite(lp), "rank": j + 1, "decoded_token": text_of(i)} for j, (i, lp) in
             enumerate(e.top)}
        d[str(t)] = {"logprob": _finite(e.logprob), "rank": e.rank, "decoded_token": text_of(t)}
        out.append(d)
    return out


def chat_logprobs(entries: list, token_ids: list[int], text_of: Callable[[int], str]) -> dict:
    def item(i: int, lp: float) -> dict:
        s = text_of(i)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(t, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for t, e in zip(token_ids, entries)]}
