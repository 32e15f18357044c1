"""vLLM's `bad_words`: words and phrases the output must not contain (`SamplingParams.bad_words`, or token sequences
as they are, `bad_words_token_ids`, HF's `bad_words_ids`).

A word is tokenized as vLLM does (`word_token_ids`): as written (leading spaces stripped), and with one leading space
where that gives another first token in as many tokens, so that it is refused at the start of the text and after a
space. A sequence's last token is then refused (its logit -inf) at each position whose output tokens just before it
are the sequence's other tokens. Only the output counts, as in vLLM: a word begun in the prompt is not matched.

A one-token sequence is refused everywhere, so it is a constant bias of -inf (`eyas.layers.penalties.PenaltyState`
writes it beside `logit_bias`). A longer one depends on the context, so under speculation each tree node is matched
against its own: the committed output's last tokens followed by its path's (`node_contexts`). A node's law is then
the one plain decoding would use after that path, and acceptance stays lossless, as with the penalties that this
travels with (`WordBans`, in `eyas.layers.penalties.Penalties`). The draft proposes under the one-token bans only
(`DRAFT_MATCHES_WORDS`): matching its levels too cost ~0.3 ms a step of SmolLM2's default tree at batch 1 (+0.23
against +0.09 ms a token at TPC 2.17; tools/diag/extras_cost.py on an H100, 2026-12-05, docs/benchmarks.md
"Session 55"), for proposals the target refuses only where a banned phrase would go on.

Everything runs on the device from fixed-size rows (CUDA graphs capture it): per sequence slot, the output's last
`MAX_WORD_TOKENS - 1` tokens (`tail`, moved on by each step's commit, `commit_tail`) and up to `MAX_LONG_WORDS`
sequences of 2 to `MAX_WORD_TOKENS` tokens."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

MAX_WORDS = 128  # bad_words entries (or token sequences) a request may give
MAX_WORD_TOKENS = 16  # tokens in one sequence
MAX_LONG_WORDS = 64  # sequences of two tokens or more a request may end up with (each word gives one or two)
TAIL = MAX_WORD_TOKENS - 1  # the output tokens a match looks back at
# whether the draft's levels match the multi-token words too (the target's nodes always do: exactness needs it)
DRAFT_MATCHES_WORDS = False


def word_token_ids(words: Iterable[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token sequences that `words` ban, as vLLM's `SamplingParams.update_from_tokenizer` makes them: each word
    with its leading spaces stripped, then with one leading space when that encodes to a different first token and
    as many tokens (a word-initial token of BPE vocabularies). `encode`: text -> ids, no special tokens. ValueError
    for a word that encodes to nothing."""
    out: list[list[int]] = []
    for w in words:
        plain = encode(w.lstrip())
        if not plain:
            raise ValueError(f"bad_words: {w!r} encodes to no tokens")
        out.append(plain)
        spaced = encode(" " + w.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def check_word_ids(seqs: list[list[int]], vocab: int) -> tuple[tuple[int, ...], ...]:
    """The distinct sequences of a request, checked against the limits (ValueError)."""
    out = tuple(dict.fromkeys(tuple(s) for s in seqs))
    for s in out:
        if len(s) > MAX_WORD_TOKENS:
            raise ValueError(f"bad_words: a word of {len(s)} tokens, more than {MAX_WORD_TOKENS}")
        if any(t >= vocab for t in s):
            raise ValueError(f"bad_words: token ids must be in [0, {vocab}), got {max(s)}")
    if sum(len(s) > 1 for s in out) > MAX_LONG_WORDS:
        raise ValueError(f"bad_words: more than {MAX_LONG_WORDS} words of several tokens")
    return out


def node_contexts(tail: torch.Tensor, path_tokens: torch.Tensor, on_path: torch.Tensor) -> torch.Tensor:
    """[B, L, W]: each of L nodes' last W context tokens, newest first, -1 before the output's start. `tail` [B, W]:
    the committed output's last W tokens, oldest first (-1 where the output is shorter); `path_tokens` [B, L, M]
    and `on_path` [B, L, M]: the node's path below the committed tokens, the tokens where `on_path` holds, in
    increasing index (a tree's nodes come after their ancestors, so that is depth order), the node's own token
    last."""
    B, L, M = path_tokens.shape
    W = tail.shape[1]
    k = torch.arange(W, device=tail.device)
    depth = on_path.sum(-1, keepdim=True)  # [B, L, 1]
    # the committed part: context position k (from the newest) is the tail's W-1-(k-depth) once k >= depth
    recent = tail[:, None].expand(B, L, W).gather(2, (W - 1 - (k - depth)).clamp(0, W - 1))
    recent = torch.where(k >= depth, recent, -1)
    if M:  # the path's part: the i-th token on the path (0-based, by index) sits depth-1-i from the newest
        back = depth - on_path.cumsum(-1)  # [B, L, M]: depth-1-i at the path's tokens
        keep = on_path & (back < W)
        at = torch.where(keep, back, W)  # the rest to a scratch column
        full = torch.cat([recent, recent.new_full((B, L, 1), -1)], 2)
        full.scatter_(2, at, torch.where(keep, path_tokens, -1))
        recent = torch.where(k < depth, full[..., :W], recent)
    return recent


def commit_tail(tail: torch.Tensor, path_tokens: torch.Tensor, num_accepted: torch.Tensor,
                bonus: torch.Tensor) -> torch.Tensor:
    """The tail [B, W] after a step that committed, per row, the first num_accepted [B] of path_tokens[:, 1:] (the
    root's token is committed already) and then the bonus [B]."""
    B, W = tail.shape
    D = path_tokens.shape[1] - 1
    j = torch.arange(D + 1, device=tail.device)
    n = num_accepted.long()[:, None]
    path = torch.cat([path_tokens[:, 1:].long(), bonus.long()[:, None]], 1)
    new = torch.where(j < n, path, torch.where(j == n, bonus.long()[:, None], -1))  # accepted, bonus, nothing
    both = torch.cat([tail, new], 1)  # [B, W + D + 1]: the W + n + 1 first are the context's end
    return both.gather(1, n + 1 + torch.arange(W, device=tail.device))


@dataclass
class WordBans:
    """One step's multi-token bad words for B rows (device tensors; a row with none has every length 0)."""
    tail: torch.Tensor  # [B, W] long: the committed output's last W tokens, oldest first, -1 where none
    prefix: torch.Tensor  # [B, NW, W] long: each sequence's tokens but the last, newest first (past its length: -1)
    length: torch.Tensor  # [B, NW] long: how many of `prefix` count (0: no sequence in this slot)
    last: torch.Tensor  # [B, NW] long: the token it refuses

    @classmethod
    def empty(cls, rows: int, device) -> "WordBans":
        """Rows with no sequences and no output (a slot's state before it is written, a graph's static inputs)."""
        z = torch.zeros(rows, MAX_LONG_WORDS, dtype=torch.long, device=device)
        return cls(torch.full((rows, TAIL), -1, dtype=torch.long, device=device),
                   torch.full((rows, MAX_LONG_WORDS, TAIL), -1, dtype=torch.long, device=device), z, z.clone())

    def rows(self, at) -> "WordBans":
        return WordBans(self.tail[at], self.prefix[at], self.length[at], self.last[at])

    def write(self, at: int, output: list[int], seqs: Iterable[tuple[int, ...]]) -> None:
        """Row `at` becomes a sequence's: the tail of its output so far and its multi-token sequences (made on the
        host, then one copy per field)."""
        tail = torch.full((TAIL,), -1, dtype=torch.long)
        prefix = torch.full((MAX_LONG_WORDS, TAIL), -1, dtype=torch.long)
        length = torch.zeros(MAX_LONG_WORDS, dtype=torch.long)
        last = torch.zeros(MAX_LONG_WORDS, dtype=torch.long)
        out = output[-TAIL:]
        if out:
            tail[TAIL - len(out):] = torch.tensor(out)
        for i, s in enumerate(x for x in seqs if len(x) > 1):
            prefix[i, :len(s) - 1] = torch.tensor(s[-2::-1])
            length[i] = len(s) - 1
            last[i] = s[-1]
        for name, row in (("tail", tail), ("prefix", prefix), ("length", length), ("last", last)):
            getattr(self, name)[at] = row.to(self.tail.device)

    def fill(self, other: "WordBans | None") -> None:
        """In place: the first rows become `other`'s, the rest (a graph's padding rows) none."""
        n = 0 if other is None else other.tail.shape[0]
        for name, pad in (("tail", -1), ("prefix", -1), ("length", 0), ("last", 0)):
            dst = getattr(self, name)
            if n:
                dst[:n].copy_(getattr(other, name), non_blocking=True)
            dst[n:].fill_(pad)

    def apply(self, logits: torch.Tensor, path_tokens: torch.Tensor, on_path: torch.Tensor,
              column_of: torch.Tensor | None = None) -> None:
        """In place, logits [B, L, K] of L nodes (paths as `node_contexts` reads them, [B, L, M] each): -inf at the
        last token of each sequence whose other tokens end the node's context. `column_of` [V]: each token's column
        of `logits` (a draft vocabulary's; -1 where it has none), None when K is the vocabulary."""
        B, L = logits.shape[:2]
        recent = node_contexts(self.tail, path_tokens, on_path)  # [B, L, W]
        W = recent.shape[-1]
        care = torch.arange(W, device=logits.device) < self.length[..., None]  # [B, NW, W]
        same = recent[:, :, None, :] == self.prefix[:, None]  # [B, L, NW, W]
        hit = ((same | ~care[:, None]).all(-1) & (self.length > 0)[:, None])  # [B, L, NW]
        col = self.last
        if column_of is not None:  # a token outside the draft vocabulary: nothing to refuse
            col = column_of[col]
            hit = hit & (col >= 0)[:, None]
            col = col.clamp_min(0)
        # added: -inf where a sequence hit, 0 where not (exact, in any order, when a token ends several sequences)
        logits.scatter_add_(2, col[:, None].expand(B, L, -1), torch.where(hit, float("-inf"), 0.0).to(logits.dtype))
