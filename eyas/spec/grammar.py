"""Guided decoding (structured outputs): a grammar state per request, which follows the speculative tree.

xgrammar compiles a JSON schema, a regular expression, a list of choices or an EBNF grammar against the tokenizer's
vocabulary (`GrammarBackend`); its matcher says which tokens may come next. A request's matcher (`GrammarState`) holds
exactly its committed tokens, and nothing else, at every step:

* After the draft has proposed a step's tree, the host reads the tree's tokens (`TreeGuide.read`). Each node gets the
  token mask of the state that the path root -> node reaches (`tree_bitmask`); the matcher itself is left as it was.
* The target's logits at every node are masked (`apply_bitmask`) before acceptance. Acceptance (greedy, or the
  lossless multi-round sampling of `eyas.spec.verifier`) so runs on the target's distribution restricted to the
  grammar, which is what plain guided decoding samples from: speculation changes nothing of the output's law, and
  greedy output equals plain greedy guided output token for token.
* A draft token that the grammar refuses has probability 0 under its parent's masked distribution, so it is never
  accepted; the nodes below it are unreachable, and their rows allow every token (a row that allows nothing would
  make NaNs in the sampler).
* The commit feeds the matcher the committed tokens only: the accepted path and the bonus token
  (`LLMEngine._commit`). A rejected branch never touched it. A grammar that is complete ends the output ("stop").

The masks need the draft's tokens on the host, so a guided step synchronises once in its middle: the tree's tokens
are read while the target's verify forward runs, and the host computes the masks meanwhile. With CUDA graphs the step
is three graphs (draft, verify, mask + accept + commit: `GraphedStep.launch_guided`); it is never overlapped with the
next step, whose masks need the grammar states after this one's commit.
The draft proposes the root's children among the tokens the grammar allows next (`TreeGuide.root_masks`: known on the
host before the step, as the state after the committed tokens); its deeper levels propose freely, since their states
depend on the tree's tokens. A proposal that breaks the grammar costs acceptance, never exactness.

A grammar may start late (`GuidedDecoding.after_token_id`, what `eyas serve --reasoning-parser` sets for a reasoning
model's `</think>`): until the output holds that token, every token is allowed and the matcher takes nothing
(`GatedGrammarState`). In a tree, the nodes below the first such token on their path get the masks of the grammar
fed the path after it, so a step that drafts the end of the reasoning and the first structured tokens is exact too.
While the gate is closed a request needs no masks at all, but for the tokens after the gate: so its steps run as
free ones (one graph, no synchronisation in the middle: `unmasked`), and where such a step commits the gate before
its last token, the commit is cut after the gate (`cut_at_gate`; `LLMEngine._decoded`). The cut is a stopping time
of the sequence (as an end-of-sequence token is), so the tokens kept follow the unmasked law they were drawn from,
and the next step, its grammar open, draws the rest under the masks. Requests with penalties or a logit bias
(`SamplingParams.has_penalties`) keep the masked steps (their device counts take every token the step commits).
"""
from __future__ import annotations

import json
import threading
from functools import lru_cache

import numpy as np
import torch

from eyas.sampling_params import GuidedDecoding

XGRAMMAR_MISSING = "guided decoding needs the xgrammar package (pip install xgrammar)"


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # a core dependency; a broken install says what is missing
        raise ValueError(f"{XGRAMMAR_MISSING}: {e}") from None
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose sentences are exactly `choices` (string literals in JSON's escaping, which xgrammar's
    EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def structural_tag(spec: dict) -> dict:
    """A structural tag as xgrammar compiles it: `{"format": ...}` as it is; vLLM's older form, `{"structures":
    [{"begin", "schema", "end"}], "triggers": [...]}`, as the same "triggered_tags" format (free text; each trigger
    opens one of the tags that begin with it, whose content follows its JSON schema until its end)."""
    if "format" in spec:
        return {"type": "structural_tag", "format": spec["format"]}
    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": {"type": "json_schema", "json_schema": s["schema"]}} for s in spec["structures"]]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": list(spec["triggers"]),
                                                 "tags": tags}}


# Where xgrammar (0.2) reports a spec it refuses: its JSON-schema, regex and EBNF front ends, and its structural-tag
# check. Its other RuntimeErrors (a failed internal check, memory) are the server's faults, not the client's.
_INPUT_ERRORS = ("json_schema_converter.cc:", "regex_converter.cc:", "grammar_parser.cc:", "Invalid structural tag")


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _strip_source(msg: str) -> str:
    """xgrammar's message without its "[time] file.cc:line: " and "Check failed: (...) is false: " prefixes."""
    return msg.split(" is false: ", 1)[-1] if "Check failed" in msg else msg.split(": ", 1)[-1]


class GrammarBackend:
    """The tokenizer's vocabulary as xgrammar sees it, and a compiler (with its own cache) of guided specs."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        """`tokenizer`: an `eyas.loader.tokenizer.Tokenizer`; `vocab_size`: the model's logits width (>= the
        tokenizer's); `stop_ids`: the tokens that may end a complete output (the model's end-of-sequence ids)."""
        xgr = _xgr()
        backend = tokenizer.backend
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        vocab = [""] * vocab_size
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                vocab[i] = token
        # special tokens (<|im_start|>, ...) as empty strings: xgrammar never allows those, where it would take
        # their literal text inside a JSON string or a regex's `.*`, text the detokenizer then drops
        for i, t in backend.get_added_tokens_decoder().items():
            if t.special and i < vocab_size:
                vocab[i] = ""
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())  # byte-level, byte-fallback or raw
        self.info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=self.stop_ids,
                                      add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(self.info)

    @property
    def words(self) -> int:
        """int32 words of a token bitmask row."""
        return (self.vocab_size + 31) // 32

    def compile(self, g: GuidedDecoding):
        """A compiled grammar; ValueError naming the field for a schema, regex or grammar that xgrammar refuses,
        RuntimeError for xgrammar's other failures (a server error, not the client's)."""
        try:
            if g.json is not None or g.json_object:  # an object, as OpenAI's json_object mode promises
                schema = g.json if isinstance(g.json, str) else json.dumps(g.json or {"type": "object"})
                # one space after ':' and ',' and no other whitespace: a free choice of whitespace lets a model
                # loop on it (a weak one does) and makes the draft's proposals disagree about layout
                return self.compiler.compile_json_schema(schema, any_whitespace=False)
            if g.regex is not None:
                return self.compiler.compile_regex(g.regex)
            if g.choice is not None:
                return self.compiler.compile_grammar(choice_grammar(g.choice))
            if g.structural_tag is not None:
                return self.compiler.compile_structural_tag(structural_tag(g.structural_tag))
            return self.compiler.compile_grammar(g.grammar)
        except RuntimeError as e:  # xgrammar's own errors: "[time] /project/cpp/file.cc:line: message"
            msg = _first_line(e)
            if not any(s in msg for s in _INPUT_ERRORS):  # a fault of xgrammar or of this server, not of the spec
                raise RuntimeError(f"guided decoding: xgrammar failed to compile a {g.kind}: {msg}") from e
            raise ValueError(f"guided decoding: invalid {g.kind}: {_strip_source(msg)}") from None
        except (ValueError, TypeError, KeyError) as e:  # a spec that `structural_tag` or xgrammar's Python refuses
            msg = f"missing field {e.args[0]!r}" if isinstance(e, KeyError) else _strip_source(_first_line(e))
            raise ValueError(f"guided decoding: invalid {g.kind}: {msg}") from None

    def state(self, g: GuidedDecoding) -> "GrammarState":
        if g.after_token_id is not None:
            return GatedGrammarState(self.compile(g), self.stop_ids, self.words, g.after_token_id)
        return GrammarState(self.compile(g), self.stop_ids, self.words)


class LazyGrammarBackend:
    """A `GrammarBackend` made on the first `get` and kept, whichever thread asks first: 0.65 s for SmolLM2's 49k
    tokens on this repository's CPU (`tools/diag/guided_mask_cost.py`), which a server spends beside startup rather
    than at its first guided request. `stop_ids` is read then (the engine's end-of-sequence ids, a set it owns)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self._args = tokenizer, vocab_size, stop_ids
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                tokenizer, vocab_size, stop_ids = self._args
                if tokenizer is None:
                    raise ValueError("guided decoding needs the model's tokenizer (this model has none)")
                self._backend = GrammarBackend(tokenizer, vocab_size, sorted(stop_ids))
            return self._backend


class GrammarState:
    """One request's grammar matcher: the state after its committed output tokens."""

    def __init__(self, compiled, stop_ids: list[int], words: int):
        xgr = _xgr()
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)
        self.words = words
        self.num_accepted = 0

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was taken: nothing may follow."""
        return self.matcher.is_terminated()

    def accept(self, tokens: list[int]) -> int:
        """Feed committed tokens; returns how many were taken: all, or fewer when one of them completed the grammar
        (the rest are dropped from the output). A token the grammar refuses is a bug upstream: RuntimeError."""
        for i, t in enumerate(tokens):
            if self.matcher.is_terminated():
                return i
            if not self.matcher.accept_token(int(t)):
                raise RuntimeError(f"the grammar refused committed token {t} (after {self.num_accepted} tokens): "
                                   "its mask was not applied")
            self.num_accepted += 1
        return len(tokens)

    def fill(self, out: torch.Tensor, row: int = 0) -> None:
        """out[row] = the mask of the tokens that may come next (all allowed once terminated)."""
        if self.matcher.is_terminated():
            out[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(out, row)

    def tree_bitmask(self, tokens: np.ndarray, parents: np.ndarray, out: torch.Tensor) -> None:
        """out [N1, words] int32 = each tree node's mask: what may follow the path root -> node (the root is the last
        committed token, which the matcher has taken). Nodes the grammar cannot reach (a refused token on their path,
        or a completed grammar above them) allow every token. `tokens`, `parents`: [N1] (the root's parent -1,
        parents before children). xgrammar walks the tree in one call (`traverse_draft_tree`), restoring the matcher
        after; `tree_bitmask_reference` is the plain walk it is held equal to."""
        N1 = len(tokens)
        first, sibling = _child_links(np.ascontiguousarray(parents, dtype=np.int64).tobytes())
        out.fill_(-1)
        if not self.matcher.is_terminated():
            self.matcher.traverse_draft_tree(first, sibling,
                                             torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)), out[:N1])
        # xgrammar leaves the rows of nodes under a refused token as they were (all allowed here) and zeroes the
        # rows of refused or terminal nodes: allowing nothing is never a valid state, so those allow everything too
        out[~out[:N1].any(-1)] = -1


class GatedGrammarState(GrammarState):
    """A grammar that starts after the output's first `after` token (the end of a reasoning model's thinking): until
    then every token is allowed and the matcher takes nothing; from the token after it on, a `GrammarState`."""

    def __init__(self, compiled, stop_ids: list[int], words: int, after: int):
        super().__init__(compiled, stop_ids, words)
        self.after = after
        self.open = False  # the `after` token is among the committed tokens

    @property
    def terminated(self) -> bool:
        return self.open and super().terminated

    def accept(self, tokens: list[int]) -> int:
        before = 0
        if not self.open:
            for before, t in enumerate(tokens, 1):
                if int(t) == self.after:
                    self.open = True
                    break
            if not self.open:
                return len(tokens)
        return before + super().accept(tokens[before:])

    def fill(self, out: torch.Tensor, row: int = 0) -> None:
        if self.open:
            super().fill(out, row)
        else:
            out[row] = -1

    def cut_at_gate(self, tokens: list[int]) -> int:
        """How many of a step's committed tokens to keep: up to the first gate token (closed), all of them else."""
        if self.open or self.after not in tokens:
            return len(tokens)
        return tokens.index(self.after) + 1

    def tree_bitmask(self, tokens: np.ndarray, parents: np.ndarray, out: torch.Tensor) -> None:
        """Open: `GrammarState.tree_bitmask`. Closed: every node allows every token, but the subtree under each node
        that is the path's first `after` token: that node gets the grammar's first mask, and its descendants the
        masks of the grammar fed the path below it (a subtree walked as a tree of its own)."""
        if self.open:
            return super().tree_bitmask(tokens, parents, out)
        N1 = len(tokens)
        out[:N1] = -1
        gate = np.full(N1, -1, dtype=np.int64)  # the node that opened the grammar on the path root -> node, or -1
        for i in range(1, N1):
            p = int(parents[i])
            if p < 0:
                continue
            gate[i] = gate[p] if gate[p] >= 0 else (i if int(tokens[i]) == self.after else -1)
        for r in np.unique(gate[gate >= 0]):
            idx = np.nonzero(gate == r)[0]  # r first: parents come before their children
            where = {int(j): k for k, j in enumerate(idx)}
            sub_parents = np.array([-1] + [where[int(parents[j])] for j in idx[1:]], dtype=np.int64)
            rows = torch.empty((len(idx), out.shape[-1]), dtype=out.dtype)
            super().tree_bitmask(tokens[idx], sub_parents, rows)
            out[torch.from_numpy(idx)] = rows


def unmasked(state, penalised: bool) -> bool:
    """Whether a request's decode step may run without its grammar's masks: a gated grammar still closed, on a
    request without penalties (the step's commit is then cut at the gate: `GatedGrammarState.cut_at_gate`)."""
    return isinstance(state, GatedGrammarState) and not state.open and not penalised


def tree_bitmask_reference(state: GrammarState, tokens, parents, out: torch.Tensor) -> None:
    """`GrammarState.tree_bitmask` the plain way: for each node, a fork of the matcher takes the path's tokens one by
    one; a refused token or a completed grammar on the way leaves the node's row allowing everything."""
    N1 = len(tokens)
    for i in range(N1):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        m = state.matcher.fork()
        ok = True
        for t in reversed(path):
            if m.is_terminated() or not m.accept_token(t):
                ok = False
                break
        if ok and not m.is_terminated():
            m.fill_next_token_bitmask(out, i)
        else:
            out[i] = -1


@lru_cache(maxsize=256)
def _child_links(parents_bytes: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """(first child, next sibling) of every node, -1 where none: the tree as `traverse_draft_tree` reads it. Keyed
    by the parents' bytes (int64): a static tree's are the same every step, so its links are made once."""
    parents = np.frombuffer(parents_bytes, dtype=np.int64)
    N1 = len(parents)
    first = np.full(N1, -1, dtype=np.int64)
    sibling = np.full(N1, -1, dtype=np.int64)
    last = {}
    for i in range(1, N1):
        p = int(parents[i])
        if p < 0:
            continue
        if first[p] < 0:
            first[p] = i
        else:
            sibling[last[p]] = i
        last[p] = i
    return torch.from_numpy(first), torch.from_numpy(sibling)


@lru_cache(maxsize=64)
def _bit_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def allowed_tokens(bitmask: torch.Tensor, V: int) -> torch.Tensor:
    """bitmask [..., words] int32 -> bool [..., V]: token t is allowed where bit t % 32 of word t // 32 is set."""
    bits = (bitmask[..., None] >> _bit_shifts(bitmask.device)) & 1
    return bits.view(*bitmask.shape[:-1], -1)[..., :V].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [..., V] = -inf where the bitmask [..., words] (same leading shape) forbids the token."""
    logits.masked_fill_(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))


class TreeGuide:
    """The masks of one decode step's trees, for the rows of a batch whose requests are guided (`states[b]`, None
    for the others; rows past them are padding). Run eagerly, `spec_step` calls `read` once the tree's tokens are
    drafted (the copy to the host is enqueued, the step goes on) and `apply` once the target's logits are computed;
    a graphed step (`eyas.engine.cuda_graph.GraphedStep.launch_guided`) reads the tokens itself and calls `masks`."""

    def __init__(self, states: list[GrammarState | None], words: int):
        self.states, self.words = states, words
        self._tokens = self._parents = self._done = None

    def masks(self, tokens: np.ndarray, parents: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        """out [B, N1, words] int32 on the host := each guided row's node masks (tokens [B, N1]; parents [N1] or
        [B, N1]), every token allowed in the other rows. Returns out."""
        out.fill_(-1)
        for b, st in enumerate(self.states):
            if st is not None:
                st.tree_bitmask(tokens[b], parents if parents.ndim == 1 else parents[b], out[b])
        return out

    def root_masks(self, out: torch.Tensor) -> torch.Tensor:
        """out [B, words] int32 on the host := each guided row's mask of what may follow its committed tokens (the
        root's children: the draft proposes among them), every token in the other rows. Returns out."""
        return next_token_masks(self.states, out)

    def read(self, node_tokens: torch.Tensor, parents: torch.Tensor) -> None:
        """Start copying the step's tree to the host: node_tokens [B, N1]; parents [N1] (a static tree) or [B, N1]."""
        cuda = node_tokens.device.type == "cuda"
        self._tokens = node_tokens.to("cpu", non_blocking=cuda)
        self._parents = parents.to("cpu", non_blocking=cuda)
        if cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    def apply(self, logits: torch.Tensor) -> None:
        """Mask logits [B, N1, V] in place: each guided row's nodes by their states' masks."""
        if self._done is not None:
            self._done.synchronize()
        B, N1, _ = logits.shape
        masks = self.masks(self._tokens.numpy(), self._parents.numpy(),
                           torch.empty((B, N1, self.words), dtype=torch.int32))
        apply_bitmask(logits, masks.to(logits.device, non_blocking=True))


def next_token_masks(states: list[GrammarState | None], out: torch.Tensor) -> torch.Tensor:
    """out [B, words] := the mask of the next token of each row's state (every token for rows without one, and for
    rows past `states`). Returns out."""
    out.fill_(-1)
    for b, st in enumerate(states):
        if st is not None:
            st.fill(out, b)
    return out


def prefill_masks(states: list[GrammarState | None], words: int) -> torch.Tensor:
    """[B, words] masks of the next token of each row's state (every token for rows without one)."""
    return next_token_masks(states, torch.empty((len(states), words), dtype=torch.int32))
