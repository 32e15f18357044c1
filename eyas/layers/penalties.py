"""Repetition penalties on the target's logits, as vLLM applies them (`SamplingParams.presence_penalty`,
`frequency_penalty`, `repetition_penalty`):

* frequency: logit[v] -= frequency_penalty * (times v is in the output so far);
* presence: logit[v] -= presence_penalty where v is in the output so far;
* repetition (CTRL's, HF's): where v is in the prompt or the output, a positive logit is divided by
  repetition_penalty and a negative one multiplied by it.

They change the target's law at each position by the tokens before it, so under speculation each tree node's
logits are penalised by the committed tokens *and the tokens on its own path* (`apply_to_tree`): a node's law is
then exactly the law plain decoding would use after that path, and acceptance stays lossless. The draft proposes
from logits penalised so too (`apply_to_nodes`), which changes only its proposals.

OpenAI's `logit_bias` (`SamplingParams.logit_bias`) travels with them: a per-row [V] bias added to the logits first
(vLLM v1's order: logit processors, then penalties), the same at every node. So does vLLM's `allowed_token_ids`: the
bias of every other token is -inf. vLLM's `bad_words` too (`eyas.layers.bad_words`): a one-token word is a bias of
-inf, a longer one is matched against each node's own context (`WordBans`)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from eyas.layers.bad_words import DRAFT_MATCHES_WORDS, WordBans, commit_tail


def penalize(logits: torch.Tensor, out_counts: torch.Tensor, seen: torch.Tensor, frequency: torch.Tensor,
             presence: torch.Tensor, repetition: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """In place: logits [..., V]; out_counts [..., V] (output occurrences), seen [..., V] (bool: in the prompt or
    the output); frequency, presence, repetition [...]: each row's coefficients; bias [..., V] (logit_bias), added
    first."""
    if bias is not None:
        logits.add_(bias.to(logits.dtype))
    rep = repetition[..., None].to(logits.dtype)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, scaled, logits))
    counts = out_counts.to(logits.dtype)
    logits.sub_(frequency[..., None].to(logits.dtype) * counts + presence[..., None].to(logits.dtype) * (counts > 0))


@dataclass
class Penalties:
    """One step's penalties for B rows: the counts of the committed tokens and each row's coefficients (device
    tensors; rows without penalties have coefficients 0, 0, 1, which change nothing)."""
    out_counts: torch.Tensor  # [B, V] float: occurrences in the committed output
    seen: torch.Tensor  # [B, V] bool: in the prompt or the committed output
    frequency: torch.Tensor  # [B]
    presence: torch.Tensor  # [B]
    repetition: torch.Tensor  # [B]
    bias: torch.Tensor  # [B, V] float: logit_bias (0 where none)
    # vLLM's min_tokens: the stop tokens (end of sequence, stop_token_ids) are refused at the next `ban_until`
    # positions of each row (0: none); the position of a tree node's token is its path's length
    ban: torch.Tensor  # [B, V] bool: the row's stop tokens
    ban_until: torch.Tensor  # [B] float: min_tokens - output tokens so far
    # vLLM's bad_words of several tokens (None when no row has any: a step, or a graph, without their work)
    words: WordBans | None = None

    @classmethod
    def of(cls, seqs, vocab: int, device) -> "Penalties | None":
        """The penalties of `seqs` (row i: seqs[i]), or None when no sequence asks for any: their rows made from the
        host's tokens as `PenaltyState` makes a slot's (a prefill's first token; a decode step gathers the slots'
        rows instead)."""
        if not any(s.params.has_penalties for s in seqs):
            return None
        state = PenaltyState(len(seqs), vocab, device)
        state.write_rows(seqs, list(range(len(seqs))))
        return state.gather(torch.arange(len(seqs), device=device), has_long_words(seqs))

    @classmethod
    def neutral(cls, rows: int, vocab: int, device, words: bool = False) -> "Penalties":
        """Buffers for `rows` rows that change nothing (a graphed step's static inputs, `fill`ed before replay);
        `words`: with bad words' rows."""
        z = torch.zeros(rows, device=device)
        return cls(torch.zeros(rows, vocab, device=device), torch.zeros(rows, vocab, dtype=torch.bool, device=device),
                   z, z.clone(), torch.ones(rows, device=device), torch.zeros(rows, vocab, device=device),
                   torch.zeros(rows, vocab, dtype=torch.bool, device=device), z.clone(),
                   WordBans.empty(rows, device) if words else None)

    @property
    def kind(self) -> int:
        """What a graph of these penalties computes: 1 counts, biases and min_tokens, 2 bad words of several tokens
        too."""
        return 1 + (self.words is not None)

    def fill(self, p: "Penalties") -> None:
        """In place: this buffer's first rows become `p`'s, the rest (a graph's padding rows) neutral."""
        n = p.out_counts.shape[0]
        for name, pad in (("out_counts", 0), ("seen", 0), ("frequency", 0), ("presence", 0), ("repetition", 1),
                          ("bias", 0), ("ban", 0), ("ban_until", 0)):
            dst = getattr(self, name)
            dst[:n].copy_(getattr(p, name), non_blocking=True)
            dst[n:].fill_(pad)
        if self.words is not None:
            self.words.fill(p.words)
        elif p.words is not None:
            raise ValueError("these penalties' buffers hold no bad words")

    def apply(self, logits: torch.Tensor) -> None:
        """In place, logits [B, V] of each row's next token after its committed tokens (a prefill's last row)."""
        penalize(logits, self.out_counts, self.seen, self.frequency, self.presence, self.repetition, self.bias)
        logits.masked_fill_(self.ban & (self.ban_until > 0)[:, None], float("-inf"))
        if self.words is not None:
            none = torch.empty(logits.shape[0], 1, 0, dtype=torch.long, device=logits.device)
            self.words.apply(logits[:, None], none, none.bool())

    def apply_to_tree(self, logits: torch.Tensor, node_tokens: torch.Tensor, ancestor_mask: torch.Tensor) -> None:
        """In place, logits [B, N+1, V] at the root (node 0) and every tree node: each penalised by the committed
        tokens and the tokens of the nodes from the root's child down to itself (`ancestor_mask` [N+1, N+1] or
        [B, N+1, N+1]: [j, a] true where a is j or an ancestor of j; the root's token is committed already)."""
        self.apply_to_nodes(logits, node_tokens[:, 1:], ancestor_mask[..., 1:])

    def for_draft(self, path_tokens: torch.Tensor, on_path: torch.Tensor):
        """The `adjust` of `eyas.spec.draft_vocab.draft_topk`: the draft's logits ([B, L, K], or [B, K] for one node)
        penalised as `apply_to_nodes` does."""
        def adjust(logits: torch.Tensor, columns: torch.Tensor | None) -> None:
            self.apply_to_nodes(logits if logits.dim() == 3 else logits[:, None], path_tokens, on_path, columns,
                                words=DRAFT_MATCHES_WORDS)
            # a row whose every column is ruled out (allowed_token_ids outside a draft vocabulary, say) stays finite:
            # its proposals are then arbitrary, but a dynamic tree's log-softmax of it is not NaN
            logits.clamp_(min=torch.finfo(logits.dtype).min)
        return adjust

    def apply_to_nodes(self, logits: torch.Tensor, path_tokens: torch.Tensor, on_path: torch.Tensor,
                       columns: torch.Tensor | None = None, words: bool = True) -> None:
        """In place, logits [B, L, K] of L tree nodes: each penalised by the committed tokens and its path's:
        `path_tokens` ([B, M]: the tokens of nodes 1..M, or [B, L, M]: each node's own) where `on_path` ([L, M] or
        [B, L, M]) is true. `columns` [K]: the token id of each column of `logits` (a draft vocabulary's), None when
        K is the vocabulary.

        Sparse: every node is first penalised by the committed counts alone (rows broadcast over the L nodes), then
        only the columns of path tokens are recomputed, from their logits before penalties and the committed count
        plus the times the token is on the node's path. The dense form (a [B, L, V] count per node) took 1.40 s a
        call against 0.82 on the CPU at B = 32, L = 49 and SmolLM2's vocabulary (`tools/diag/node_penalty_cost.py`,
        docs/bench/session53_node_penalties_cpu.json). `tests/test_penalties.py` holds it to a loop over every
        node's path."""
        B, L = logits.shape[:2]
        M = path_tokens.shape[-1]
        rows = (slice(None), None)  # each row's [V] or [K] broadcast over the nodes
        counts, seen, bias = self.out_counts, self.seen, self.bias
        inv = None
        words = words and self.words is not None
        if columns is not None:
            counts, seen, bias = counts[:, columns], seen[:, columns], bias[:, columns]
            if M or words:  # token id -> column (-1: none)
                inv = torch.full((self.out_counts.shape[-1],), -1, dtype=torch.long, device=logits.device)
                inv[columns] = torch.arange(columns.shape[0], device=logits.device)
        if M:
            tokens = path_tokens if path_tokens.dim() == 3 else path_tokens[:, None].expand(B, L, M)
            on = on_path.to(logits.device)
            on = on if on.dim() == 3 else on[None].expand(B, L, M)
            if columns is None:
                col, eff = tokens, tokens
            else:  # a token outside the draft vocabulary stands in for its first column (written, not changed)
                col = inv[tokens]
                eff = torch.where(col >= 0, tokens, columns[0])
                col = col.clamp_min(0)
            before = logits.gather(2, col)  # [B, L, M]
            extra = ((eff[..., :, None] == tokens[..., None, :]) & on[..., None, :]).sum(-1)  # on the node's path
        penalize(logits, counts[rows], seen[rows], self.frequency[rows], self.presence[rows], self.repetition[rows],
                 bias[rows])
        if M:
            flat = eff.reshape(B, L * M)
            penalize(before, self.out_counts.gather(1, flat).view(B, L, M) + extra, extra > 0, self.frequency[rows],
                     self.presence[rows], self.repetition[rows], self.bias.gather(1, flat).view(B, L, M))
            logits.scatter_(2, col, torch.where(extra > 0, before, logits.gather(2, col)))
        # min_tokens: a node's token sits `depth` positions after the committed ones (its path's length)
        depth = on.sum(-1) if M else torch.zeros(B, L, device=logits.device)
        ban = self.ban if columns is None else self.ban[:, columns]
        logits.masked_fill_(ban[:, None, :] & (depth < self.ban_until[:, None])[..., None], float("-inf"))
        if words:  # each node's context: the committed output's end, then its path
            if not M:
                tokens = torch.empty(B, L, 0, dtype=torch.long, device=logits.device)
                on = tokens.bool()
            self.words.apply(logits, tokens, on, inv)


class PenaltyState:
    """The penalties' counts kept on the device per sequence slot (the runner's `slot` rows; row `num_slots` is the
    padding rows' scratch), so that a decode step's `Penalties` cost no host work over the context.

    A slot's row is made from the host's tokens once (`penalties`: when the row does not hold the tokens of the
    sequence now in the slot, which `rows` records as (request id, tokens counted)); each step then adds the tokens
    it committed on the device (`commit`, from the step's outputs), and `collect` moves the record on with the
    host's commit. Rows of sequences without penalties hold neutral coefficients and no bias, whatever their
    counts. Allocated by the runner when a step first needs penalties: [S + 1, V] counts (float32), prompt tokens
    (bool), bias (float32) and stop tokens (bool, min_tokens'), [S + 1, 3] coefficients and [S + 1] min_tokens (the
    output's length, which min_tokens is held against, is the row's count total)."""

    def __init__(self, rows: int, vocab: int, device):
        """`rows`: the runner's slots and its scratch slot (num_slots + 1)."""
        self.counts = torch.zeros(rows, vocab, device=device)  # occurrences in the output
        self.prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=device)  # in the prompt
        self.bias = torch.zeros(rows, vocab, device=device)
        self.coef = torch.tensor([[0.0, 0.0, 1.0]] * rows, device=device)  # frequency, presence, repetition
        self.ban = torch.zeros(rows, vocab, dtype=torch.bool, device=device)  # stop tokens (min_tokens)
        self.min_tokens = torch.zeros(rows, device=device)
        self.words = WordBans.empty(rows, device)  # bad words of several tokens, and the output's last tokens
        self.rows: dict[int, tuple[str, int | None]] = {}  # slot -> (request id, tokens counted; None: neutral)
        self.rows_made = 0  # rows written from the host's tokens (once per request and slot, unless preempted)

    def _make_rows(self, seqs) -> None:
        """Write the rows of `seqs` whose record is stale (`write_rows`, each in its slot)."""
        stale = [s for s in seqs if self.rows.get(s.slot) != self._record(s)]
        if not stale:
            return
        self.write_rows(stale, [s.slot for s in stale])
        for s in stale:
            self.rows[s.slot] = self._record(s)
        self.rows_made += len(stale)

    def write_rows(self, seqs, at: list[int]) -> None:
        """Rows `at` become those of `seqs`: counts, prompt tokens, bias, stop tokens, min_tokens and
        coefficients from the host's state (one small copy of token ids)."""
        dev = self.counts.device
        slots = torch.tensor(at, device=dev)
        self.counts[slots] = 0
        self.prompt[slots] = False
        self.bias[slots] = 0
        self.ban[slots] = False
        self.min_tokens[slots] = torch.tensor([float(s.params.min_tokens) for s in seqs], device=dev)
        self.coef[slots] = torch.tensor([[s.params.frequency_penalty, s.params.presence_penalty,
                                          s.params.repetition_penalty] if s.params.has_penalties else [0.0, 0.0, 1.0]
                                         for s in seqs], device=dev)
        pen = [(s, r) for s, r in zip(seqs, at) if s.params.has_penalties]
        if pen:
            outs = [s.output_ids for s, _ in pen]
            prompts = [s.token_ids[:len(s.token_ids) - len(s.output_ids)] for s, _ in pen]
            n = sum(len(x) for x in outs)
            idx = np.stack([  # [2, n + m]: (row, token) of every output token, then of every prompt token
                np.concatenate([np.repeat([r for _, r in pen], [len(x) for x in outs]),
                                np.repeat([r for _, r in pen], [len(x) for x in prompts])]),
                np.fromiter(itertools.chain(*outs, *prompts), dtype=np.int64)])
            idx = torch.from_numpy(idx).to(dev)
            self.counts.index_put_((idx[0, :n], idx[1, :n]), torch.ones(n, device=dev), accumulate=True)
            self.prompt[idx[0, n:], idx[1, n:]] = True
            banned = [(r, t) for s, r in pen if s.params.min_tokens for t in s.stop_ids]
            if banned:
                r, t = zip(*banned)
                self.ban[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = True
            allowed = [(r, s.params.allowed_token_ids) for s, r in pen if s.params.allowed_token_ids is not None]
            if allowed:  # every other token's bias -inf (allowed_token_ids)
                r, ts = zip(*allowed)
                self.bias[torch.tensor(r, device=dev)] = float("-inf")
                rows = torch.tensor([x for x, t in allowed for _ in t], device=dev)
                self.bias[rows, torch.tensor([x for t in ts for x in t], device=dev)] = 0.0
            biased = [(r, t, b) for s, r in pen for t, b in (s.params.logit_bias or {}).items()
                      if s.params.allowed_token_ids is None or t in s.params.allowed_token_ids]
            if biased:
                r, t, b = zip(*biased)
                self.bias[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = torch.tensor(b, device=dev)
            single = [(r, w[0]) for s, r in pen for w in _bad_words(s) if len(w) == 1]
            if single:  # bad words of one token: refused everywhere
                r, t = zip(*single)
                self.bias[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = float("-inf")
        self.words.length[slots] = 0  # no bad words of several tokens, unless written below
        for s, r in zip(seqs, at):
            if has_long_words([s]):
                self.words.write(r, s.output_ids, _bad_words(s))

    @staticmethod
    def _record(s) -> tuple[str, int | None]:
        return (s.request_id, len(s.token_ids) if s.params.has_penalties else None)

    def penalties(self, seqs, slots: torch.Tensor) -> Penalties:
        """The step's `Penalties` for `seqs` (rows made where stale), gathered on the device from the rows `slots`
        ([B] device tensor: the sequences' slots, then any padding rows' scratch slot)."""
        self._make_rows(seqs)
        return self.gather(slots, has_long_words(seqs))

    def gather(self, slots: torch.Tensor, words: bool = False) -> Penalties:
        """The `Penalties` of the rows `slots` ([B] device tensor), as they are; `words`: with the bad words of
        several tokens (some row has them)."""
        counts = self.counts[slots]
        coef = self.coef[slots]
        return Penalties(counts, self.prompt[slots] | (counts > 0), coef[:, 0], coef[:, 1], coef[:, 2],
                         self.bias[slots], self.ban[slots], self.min_tokens[slots] - counts.sum(-1),
                         self.words.rows(slots) if words else None)

    def commit(self, slots: torch.Tensor, path_tokens: torch.Tensor, num_accepted: torch.Tensor,
               bonus: torch.Tensor, words: bool = False) -> None:
        """On the device, after a step (`DecodeOutputs`): each row's counts gain the tokens it committed, its
        accepted path past the root (path_tokens [B, D+1], the first num_accepted [B] after the root) and the
        bonus [B]; with `words` (the step's penalties had bad words) their output tails move on too (a row with bad
        words is in no step without them). The padding rows' scratch row gains theirs, which nothing reads."""
        if words:
            at = slots.long()
            self.words.tail[at] = commit_tail(self.words.tail[at], path_tokens, num_accepted, bonus)
        D = path_tokens.shape[1] - 1
        tokens = torch.cat([path_tokens[:, 1:], bonus[:, None]], 1).long()  # [B, D+1]
        take = torch.arange(D + 1, device=tokens.device)[None] < num_accepted[:, None]
        take[:, D] = True  # the bonus
        tokens = torch.where(take, tokens, 0)  # past the accepted path: whatever the step left there, counted 0 times
        rows = slots.long()[:, None].expand_as(tokens)
        self.counts.index_put_((rows, tokens), take.to(self.counts.dtype), accumulate=True)

    def collect(self, seqs, new_tokens) -> None:
        """The host committed `new_tokens` (per sequence) of a step that `commit` counted: records move on. A
        sequence that ended (its tokens may have been cut) keeps a stale record, which its slot's next sequence
        replaces."""
        for s, toks in zip(seqs, new_tokens):
            if self.rows.get(s.slot) == self._record(s) and s.params.has_penalties and toks:
                self.rows[s.slot] = (s.request_id, len(s.token_ids) + len(toks))


def _bad_words(s) -> tuple[tuple[int, ...], ...]:
    """A sequence's bad words as token sequences (`Sequence.bad_words`, set by the engine from the request)."""
    return getattr(s, "bad_words", ())


def has_long_words(seqs) -> bool:
    """Whether some sequence has a bad word of several tokens (its steps then match contexts, `WordBans`)."""
    return any(len(w) > 1 for s in seqs for w in _bad_words(s))
