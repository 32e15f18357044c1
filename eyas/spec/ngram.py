"""N-gram speculation (prompt lookup): drafts without a draft model, for any target (`draft="ngram"`).

The proposal for a sequence is what followed the last time its last n tokens (prompt and output so far) appeared
earlier in it, for the longest n in [n_min, n_max] that appears: the k tokens after that occurrence (the most recent
one). Where the continuation runs into the end of the sequence, it goes on with itself (a repetition of period p
continues with period p). Output that copies from the prompt or repeats itself (code edits, summaries, quoting,
extraction, lists) is proposed whole; free prose seldom is.

The proposals are a chain (`chain:k`), verified by the target as any draft's: greedy output equals plain decoding's
token for token, and sampled output follows the target's law (a proposal is a function of the history, so the
lossless acceptance of `eyas.spec.verifier` holds for it as for a greedy draft). They are made on the host from the
committed tokens (`ModelRunner.decode_inputs`), sent with the step's other inputs, and replace the draft's levels in
the step (`eyas.spec.step.draft_phase`). A step in which no sequence has a match is a plain decode step, so text that
repeats nothing costs what plain decoding costs; the steps are never overlapped (the next step's proposals need this
one's tokens on the host).

A sequence's n-grams are kept in a map from each n-gram to the end of its latest occurrence (`NgramIndex`), which
takes only the tokens added since the last step: a step's proposals cost the same at any context length, where a
scan of the whole context grows with it (`tools/diag/ngram_cost.py`; docs/benchmarks.md, "Session 56").
`propose` (numpy, a scan) and `propose_reference` (a plain loop) are the references it is held equal to.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

N_MIN, N_MAX = 2, 4  # the n-gram sizes tried by default (longest first)


@dataclass(frozen=True)
class NgramProposer:
    n_min: int = N_MIN
    n_max: int = N_MAX

    def __post_init__(self):
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")

    @classmethod
    def parse(cls, spec: str) -> "NgramProposer":
        """"ngram" (sizes 2..4) or "ngram:N_MIN:N_MAX"."""
        m = re.fullmatch(r"ngram(?::(\d+):(\d+))?", spec)
        if m is None:
            raise ValueError(f"an n-gram draft is 'ngram' or 'ngram:N_MIN:N_MAX', got {spec!r}")
        return cls(int(m.group(1)), int(m.group(2))) if m.group(1) else cls()

    def propose_for(self, seq, k: int) -> list[int] | None:
        """`propose` for a running sequence (`eyas.engine.sequence.Sequence`), through its own `NgramIndex`."""
        if seq.ngram_index is None:
            seq.ngram_index = NgramIndex(self.n_min, self.n_max)
        return seq.ngram_index.propose(seq.token_ids, k)


class NgramIndex:
    """One sequence's n-grams (n_min..n_max) -> the end (exclusive) of their latest occurrence that ends before the
    last token, brought up to date with the tokens added since the last call. Tokens only ever grow (a sequence's
    output is appended to); a shorter sequence than before starts the index afresh."""

    def __init__(self, n_min: int = N_MIN, n_max: int = N_MAX):
        self.n_min, self.n_max = n_min, n_max
        self._clear()

    def _clear(self) -> None:
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in range(self.n_min, self.n_max + 1)}
        self.upto = 0  # the n-grams ending (exclusive) at 1..upto are in

    def propose(self, tokens: list[int], k: int) -> list[int] | None:
        """`propose(tokens, k, n_min, n_max)`, from the index."""
        L = len(tokens)
        if L - 1 < self.upto:  # not the tokens indexed before
            self._clear()
        for e in range(self.upto + 1, L):  # the n-grams tokens[e - n: e] that end before the last token
            for n, m in self.ends.items():
                if e >= n:
                    m[tuple(tokens[e - n: e])] = e
        self.upto = max(self.upto, L - 1)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            e = self.ends[n].get(tuple(tokens[L - n:]))
            if e is not None:
                return _continue(tokens, e, k)
        return None


def ngram_proposer(draft) -> NgramProposer | None:
    """The proposer a `draft` argument asks for ("ngram", "ngram:N_MIN:N_MAX"; ValueError for another "ngram:..."),
    None for any other argument (a draft model's)."""
    if isinstance(draft, str) and (draft == "ngram" or draft.startswith("ngram:")):
        return NgramProposer.parse(draft)
    return None


def _continue(tokens, start: int, k: int) -> list[int]:
    """k tokens from `start` on, the sequence going on with what it proposes past its end."""
    out: list[int] = []
    L = len(tokens)
    for i in range(k):
        p = start + i
        out.append(int(tokens[p]) if p < L else out[p - L])
    return out


def propose(tokens, k: int, n_min: int = N_MIN, n_max: int = N_MAX) -> list[int] | None:
    """The k tokens that followed the most recent earlier occurrence of the longest suffix of `tokens` (n in
    [n_min, n_max]) that occurred before; None where none did."""
    a = np.asarray(tokens, dtype=np.int64)
    L = len(a)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(a[:L - 1], n)  # starts 0 .. L-1-n: not the suffix
        hits = np.flatnonzero((windows == a[L - n:]).all(axis=1))
        if len(hits):
            return _continue(a, int(hits[-1]) + n, k)
    return None


def propose_reference(tokens: list[int], k: int, n_min: int = N_MIN, n_max: int = N_MAX) -> list[int] | None:
    """`propose` as a plain loop."""
    L = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if n > L - 1:
            continue
        suffix = tokens[L - n:]
        for j in range(L - n - 1, -1, -1):
            if tokens[j: j + n] == suffix:
                seq = list(tokens)
                out = []
                for i in range(k):
                    out.append(seq[j + n + i])
                    seq.append(out[-1])
                return out
    return None
