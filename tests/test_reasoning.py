"""Reasoning models: a grammar that starts after the thinking (`GuidedDecoding.after_token_id`,
`eyas.spec.grammar.GatedGrammarState`) and the server's reasoning parsers (`eyas.serve.reasoning`).

Oracles: a fresh xgrammar matcher fed only what follows the path's first gate token (the tree's masks); the free
output (a gated guided output equals it up to and including the gate); plain gated guided decoding (speculation,
token for token); string splitting at the tags (the parsers), whole and in any pieces."""
import json

import numpy as np
import pytest
import torch

from eyas import LLM, GuidedDecoding, SamplingParams
from eyas.spec.grammar import GatedGrammarState, GrammarBackend, allowed_tokens
from helpers import UNTHINK, think_tokenizer, write_mirror_pair
from test_guided import A_SCHEMA, GUIDES, fresh_mask


@pytest.fixture(scope="module")
def think_backend():
    tok = think_tokenizer()
    return GrammarBackend(tok, tok.vocab_size, [tok.eos_token_id]), tok


def gated_row(be, compiled, gate: int, history: list[int]) -> torch.Tensor:
    """The oracle of a gated grammar's mask after `history`: every token before the gate; then a fresh matcher fed
    what follows the first gate (every token where it refused one or has terminated)."""
    if gate not in history:
        return torch.full((be.words,), -1, dtype=torch.int32)
    ref = fresh_mask(be, compiled, history[history.index(gate) + 1:], be.words)
    return torch.full((be.words,), -1, dtype=torch.int32) if ref is None else ref


@pytest.mark.parametrize("g", GUIDES, ids=lambda g: g.kind)
def test_gated_tree_masks_follow_each_path(think_backend, g):
    """A gated grammar's node masks: all tokens above the path's first gate token, then the grammar's masks fed the
    path below it, for random trees holding gate tokens at several depths (some twice on a path), before and after
    the committed history opened it; the committed state (`fill`, `terminated`) agrees too."""
    be, tok = think_backend
    gate = tok.backend.token_to_id(UNTHINK)
    V = be.vocab_size
    compiled = be.compile(g)
    rng = np.random.default_rng(1)
    opened_seen = gated_nodes = 0
    for trial in range(16):
        state = be.state(GuidedDecoding(**{**_fields(g), "after_token_id": gate}))
        assert isinstance(state, GatedGrammarState)
        history = [int(t) for t in rng.integers(0, V, int(rng.integers(0, 4))) if t != gate]
        if trial % 3 == 2:  # opened: the gate, then a token the grammar allows
            history.append(gate)
            ok = torch.nonzero(allowed_tokens(gated_row(be, compiled, gate, history), V)).flatten().tolist()
            history.append(int(rng.choice([t for t in ok if t not in be.stop_ids])))
        assert state.accept(history) == len(history)
        assert state.open == (gate in history)
        opened_seen += state.open
        got = torch.zeros(1, be.words, dtype=torch.int32)
        state.fill(got, 0)
        assert torch.equal(got[0], gated_row(be, compiled, gate, history))
        N1 = int(rng.integers(2, 16))
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, N1)])
        tokens = np.zeros(N1, dtype=np.int64)
        for i in range(1, N1):  # the gate often, else a token the path's state allows, sometimes any
            path, j = [], parents[i]
            while j > 0:
                path.append(int(tokens[j]))
                j = parents[j]
            row = gated_row(be, compiled, gate, history + path[::-1])
            ok = torch.nonzero(allowed_tokens(row, V)).flatten().tolist()
            r = rng.random()
            tokens[i] = gate if r < 0.3 else (int(rng.choice(ok)) if r < 0.85 else int(rng.integers(0, V)))
        out = torch.zeros(N1, be.words, dtype=torch.int32)
        state.tree_bitmask(tokens, parents, out)
        for i in range(N1):
            path, j = [], i
            while j > 0:
                path.append(int(tokens[j]))
                j = parents[j]
            full = history + path[::-1]
            gated_nodes += gate in full and not state.open
            assert torch.equal(out[i], gated_row(be, compiled, gate, full)), (trial, i)
        assert state.open == (gate in history)  # the walk left the state as it was
    assert opened_seen >= 4 and gated_nodes > 20


def _fields(g: GuidedDecoding) -> dict:
    return {k: getattr(g, k) for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")}


def test_gate_token_is_checked():
    with pytest.raises(ValueError, match="after_token_id"):
        GuidedDecoding(json_object=True, after_token_id=-1)
    with pytest.raises(ValueError, match="after_token_id"):
        GuidedDecoding(json_object=True, after_token_id=True)


# ---- the engine: a grammar after the gate, with speculation ----------------------------------------------------------

@pytest.fixture(scope="module")
def think_mirror(tmp_path_factory):
    """The mirror pair (a draft that nearly copies its target) over the tiny tokenizer with `<think>` tokens."""
    import json as _json
    tok = think_tokenizer()
    target, draft = write_mirror_pair(tmp_path_factory.mktemp("think"), vocab=tok.vocab_size, layers=2)
    tok.backend.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(_json.dumps({"eos_token": "<|end|>", "chat_template": TEMPLATE}))
    return target, draft, tok


TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: <think>"


@pytest.mark.parametrize("spec", ["chain:3", "tree:8", "dyn:k4d3n8"])
def test_gated_guided_speculation_equals_plain(think_mirror, spec):
    """Greedy, with the gate set to a token the free output writes a few tokens in: the gated guided output equals
    the free output up to and including the gate, its rest matches the guide, and speculation (with a small pool,
    so that requests are preempted and their grammar rebuilt from their output) changes no token."""
    target, draft, tok = think_mirror
    plain = LLM(str(target), device="cpu", dtype="float32")
    fast = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec, num_blocks=30,
               block_size=4)
    prompts = ["Hello there", "yes or no?", "abcabc"]
    free = [o.token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))]
    guides = [GuidedDecoding(json=A_SCHEMA), GuidedDecoding(regex=r"(yes|no), [0-9]{1,3}!"),
              GuidedDecoding(choice=["a", "ab", "abc", "ba"])]
    accepted = 0
    for k in (2, 5):  # the gate: the free output's k-th token (where it first appears)
        gates = [f[k] for f in free]
        params = [SamplingParams(max_tokens=40, temperature=0.0,
                                 guided=GuidedDecoding(**{**_fields(g), "after_token_id": gate}))
                  for g, gate in zip(guides, gates)]
        a = plain.generate(prompts, params)
        b = fast.generate(prompts * 3, params * 3)  # three times over, so that the pool runs short
        assert [o.token_ids for o in b] == [o.token_ids for o in a] * 3
        for f, g, gate, x, y in zip(free, guides, gates, a, b):
            cut = f.index(gate) + 1
            assert x.token_ids[:cut] == f[:cut]
            assert x.token_ids == y.token_ids, (spec, g.kind)
            rest = tok.decode(x.token_ids[cut:])
            assert x.finish_reason == "stop", (g.kind, rest)
            if g.json is not None:
                assert isinstance(json.loads(rest)["a"], int)
            elif g.regex is not None:
                import re
                assert re.fullmatch(g.regex, rest)
            else:
                assert rest in g.choice
        accepted += sum(sum(o.stats.accepted_by_depth) for o in b)
    assert accepted > 0
    assert fast.engine.scheduler.num_preemptions > 0
    assert fast.engine.blocks.num_used == 0
