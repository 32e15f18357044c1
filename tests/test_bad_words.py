"""vLLM's `bad_words` (eyas.layers.bad_words). The words are tokenized by vLLM's rule; each tree node's context (the
committed output's end, then its path) and the tail a step's commit leaves equal lists built by hand; the bans of a
batch of nodes equal a loop over each node's context; greedy output with bad words equals a dense loop that refuses
them from the output so far (plain and speculative, static, chain and dynamic trees, through slot reuse and
preemption), and the banned sequences never appear. The law at temperature 1 is held to the enumerated one in
tests/test_penalties.py (`test_joint_law_with_penalties`, "bad_words")."""
import random

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.layers.bad_words import (MAX_LONG_WORDS, MAX_WORD_TOKENS, WordBans, commit_tail, node_contexts,
                                   word_token_ids)
from helpers import write_mirror_and_random
from test_penalties import PARAMS, SPECS, _dense_greedy, _prompts, filled_from_fewer_rows, pair_llm


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_mirror_and_random(tmp_path_factory)


def test_word_token_ids_follow_vllms_rule():
    """As written (leading spaces stripped), and with a leading space where that encodes to another first token in
    as many tokens."""
    enc = {"cat": [5], " cat": [9], "hot dog": [3, 4], " hot dog": [8, 4], "x": [7], " x": [7], "big": [1, 2],
           " big": [6], "": []}.__getitem__
    assert word_token_ids(["cat", "  hot dog"], enc) == [[5], [9], [3, 4], [8, 4]]
    assert word_token_ids(["x"], enc) == [[7]]  # the same first token
    assert word_token_ids([" big"], enc) == [[1, 2]]  # another length
    with pytest.raises(ValueError, match="encodes to no tokens"):
        word_token_ids(["cat", ""], enc)


def _context(output, tokens, on):
    """A node's context, oldest first: the output, then its path's tokens in index order."""
    return list(output) + [int(t) for t, o in zip(tokens, on) if o]


def test_node_contexts_and_commit_tail_equal_lists():
    g = random.Random(0)
    W, B, L, M = 5, 4, 6, 7
    outputs = [[g.randrange(30) for _ in range(n)] for n in (0, 2, 5, 9)]
    tail = torch.tensor([[-1] * (W - len(o[-W:])) + o[-W:] for o in outputs])
    tokens = torch.randint(0, 30, (B, L, M), generator=torch.Generator().manual_seed(1))
    on = torch.rand(B, L, M, generator=torch.Generator().manual_seed(2)) < 0.5
    got = node_contexts(tail, tokens, on)
    for b in range(B):
        for j in range(L):
            ctx = _context(outputs[b], tokens[b, j].tolist(), on[b, j].tolist())[::-1][:W]
            assert got[b, j].tolist() == ctx + [-1] * (W - len(ctx)), (b, j)
    assert node_contexts(tail, tokens[..., :0], on[..., :0]).tolist() == [[r[::-1]] * L for r in tail.tolist()]
    D = 4
    path = torch.randint(0, 30, (B, D + 1), generator=torch.Generator().manual_seed(3))
    acc, bonus = torch.tensor([0, 4, 2, 1]), torch.tensor([11, 12, 13, 14])
    got = commit_tail(tail, path, acc, bonus)
    for b in range(B):
        o = outputs[b] + path[b, 1: 1 + acc[b]].tolist() + [int(bonus[b])]
        assert got[b].tolist() == [-1] * (W - len(o[-W:])) + o[-W:], b


def test_word_bans_equal_a_loop_over_each_nodes_context():
    """`WordBans.apply` (what each tree node of the target gets, and the draft's with `DRAFT_MATCHES_WORDS`): per
    row its own words, per node its
    own path; a draft vocabulary's columns without some words' last tokens; words longer than the context, and a
    word begun in the committed output and ended on the path."""
    g = torch.Generator().manual_seed(4)
    V, B, L, M = 9, 3, 8, 4
    outputs = [[], [1, 2, 3], [4, 4, 4, 4, 4, 4]]
    words = [[(1, 2), (3, 0, 1), (5, 6, 7, 8)], [(3, 1), (2, 3, 4), (1, 2, 3, 4, 5)], [(4, 4), (4, 5, 6), (0, 1)]]
    bans = WordBans.empty(B, "cpu")
    for b in range(B):
        bans.write(b, outputs[b], words[b] + [(7,)])  # a one-token word is the bias's business, not this
    columns = torch.tensor([0, 1, 2, 4, 5, 6, 8])
    for cols in (None, columns):
        for _ in range(20):
            tokens = torch.randint(0, 6, (B, L, M), generator=g)
            on = torch.rand(B, L, M, generator=g) < 0.6
            K = V if cols is None else len(cols)
            logits = torch.randn(B, L, K, generator=g)
            got = logits.clone()
            inv = None
            if cols is not None:
                inv = torch.full((V,), -1)
                inv[cols] = torch.arange(len(cols))
            bans.apply(got, tokens, on, inv)
            want = logits.clone()
            ids = list(range(V)) if cols is None else cols.tolist()
            for b in range(B):
                for j in range(L):
                    ctx = _context(outputs[b], tokens[b, j].tolist(), on[b, j].tolist())
                    for w in words[b]:
                        if len(ctx) >= len(w) - 1 and ctx[len(ctx) - len(w) + 1:] == list(w[:-1]) and w[-1] in ids:
                            want[b, j, ids.index(w[-1])] = float("-inf")
            assert torch.equal(got, want)
            assert got.isinf().any()  # some node met a word


def _has(out: list, word) -> bool:
    n = len(word)
    return any(tuple(out[i: i + n]) == tuple(word) for i in range(len(out) - n + 1))


def _words_from(out: list) -> list:
    """Bad words that plain greedy decoding meets: a pair, a triple and a token of its output."""
    return [out[3:5], out[7:10], [out[12]]]


@pytest.mark.parametrize("spec", [None] + SPECS)
def test_greedy_with_bad_words_equals_a_dense_loop(pairs, spec):
    """Words taken from each prompt's unbanned output (so they would appear), beside penalties, and requests
    without bad words in the same batch: every output equals the dense loop's and holds none of its words."""
    llm = pair_llm(pairs, spec)
    prompts = _prompts()
    free = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    pens = [dict(bad_words_token_ids=_words_from(o.token_ids)) for o in free]
    pens[1].update(PARAMS[0])
    pens.append({})  # no words: its row has none, in steps that match the others'
    prompts = prompts + prompts[:1]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=24, ignore_eos=True, **p) for p in pens])
    for p, o, pen, f in zip(prompts, outs, pens, free + free[:1], strict=True):
        assert o.token_ids == _dense_greedy(llm.target, p, 24, **pen), pen
        assert not any(_has(o.token_ids, w) for w in pen.get("bad_words_token_ids", [])), pen
        assert (o.token_ids != f.token_ids) == bool(pen)
    if spec is not None:  # paths were accepted, so the nodes' own contexts were matched
        assert sum(o.stats.committed for o in outs) > 1.3 * sum(o.stats.target_calls for o in outs)


@pytest.mark.parametrize("spec", ["chain:4", "dyn:k3d4n8"])
def test_the_draft_may_match_the_words_too(pairs, spec, monkeypatch):
    """`DRAFT_MATCHES_WORDS` (off by default: it costs more than it buys) has the draft's levels match the words as
    the target's nodes do: the output is the same dense loop's."""
    import eyas.layers.penalties as pen
    monkeypatch.setattr(pen, "DRAFT_MATCHES_WORDS", True)
    target, draft = pairs["mirror"]
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=4, draft=str(draft), speculation=spec)
    free = llm.generate(_prompts(), SamplingParams(max_tokens=24, ignore_eos=True))
    pens = [dict(bad_words_token_ids=_words_from(o.token_ids)) for o in free]
    outs = llm.generate(_prompts(), [SamplingParams(max_tokens=24, ignore_eos=True, **p) for p in pens])
    for p, o, pe in zip(_prompts(), outs, pens, strict=True):
        assert o.token_ids == _dense_greedy(llm.target, p, 24, **pe)


@pytest.mark.parametrize("setting", [dict(max_num_seqs=2), dict(num_blocks=30)], ids=["slots_reused", "preempt"])
def test_bad_word_rows_follow_slots_through_reuse_and_preemption(pairs, setting):
    """A slot's words and output tail are written again for each request (none for a request without words in a
    slot a request with words left), and from the output so far after a preemption."""
    target, draft = pairs["mirror"]
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=4, draft=str(draft), speculation="chain:4",
              **setting)
    free = llm.generate(_prompts(), SamplingParams(max_tokens=24, ignore_eos=True))
    words = [dict(bad_words_token_ids=_words_from(o.token_ids)) for o in free]
    pens = [words[0], {}, words[1], PARAMS[2], words[2], {}, words[3], dict(words[0], **PARAMS[1])]
    prompts = (_prompts() * 2)[:len(pens)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=24, ignore_eos=True, **p) for p in pens])
    for p, o, pen in zip(prompts, outs, pens, strict=True):
        assert o.token_ids == _dense_greedy(llm.target, p, 24, **pen), pen
    if "num_blocks" in setting:
        assert llm.engine.scheduler.num_preemptions > 0


def test_static_buffers_with_words_filled_from_fewer_rows():
    """A graph's static penalties with bad words (`Penalties.neutral(..., words=True)`, `fill`ed): its first rows
    ban as the step's own penalties do, its padding rows (a wider batch's before) ban nothing; buffers without
    words refuse penalties with them."""
    from types import SimpleNamespace

    from eyas.layers.penalties import Penalties
    V = 8
    seq = lambda out, words: SimpleNamespace(  # noqa: E731
        token_ids=[0] + out, output_ids=out, params=SamplingParams(bad_words_token_ids=[list(w) for w in words]),
        bad_words=words)
    wide = [seq([1, 2], ((2, 3),))] * 3
    step = [seq([4, 5], ((5, 6), (6, 7))), seq([1], ((1, 2, 3),))]
    want, _ = filled_from_fewer_rows(wide, step, V, [0, 2, 6], words=True)
    # row 0: 6 after the root (5), 7 after node 2 (6); row 1: 3 after node 1 (1, 2)
    assert want[0, 0, 6] == want[0, 2, 7] == want[1, 1, 3] == float("-inf")
    assert want.isinf().sum() == 3
    with pytest.raises(ValueError, match="no bad words"):
        Penalties.neutral(2, V, "cpu").fill(Penalties.of(step, V, "cpu"))


def test_bad_words_are_refused(pairs):
    for bad in (["a", 3], "word", ["  "], [""]):
        with pytest.raises(ValueError, match="bad_words must be"):
            SamplingParams(bad_words=bad)
    for bad in ([[]], [[1, -2]], [3], [[True]]):
        with pytest.raises(ValueError, match="bad_words_token_ids must be"):
            SamplingParams(bad_words_token_ids=bad)
    with pytest.raises(ValueError, match="at most 128 words"):
        SamplingParams(bad_words=["a"] * 100, bad_words_token_ids=[[1]] * 29)
    from eyas.sampling_params import GuidedDecoding
    with pytest.raises(ValueError, match="bad_words with guided decoding"):
        SamplingParams(bad_words=["a"], guided=GuidedDecoding(regex="a+"))
    target, _ = pairs["mirror"]
    llm = LLM(str(target), device="cpu", dtype="float32")  # no tokenizer
    cases = [(dict(bad_words=["cat"]), "needs the model's tokenizer"),
             (dict(bad_words_token_ids=[[1] * (MAX_WORD_TOKENS + 1)]), f"more than {MAX_WORD_TOKENS}"),
             (dict(bad_words_token_ids=[[i // 24, i % 24] for i in range(MAX_LONG_WORDS + 1)]),
              f"more than {MAX_LONG_WORDS} words"),
             (dict(bad_words_token_ids=[[3, 24]]), r"token ids must be in \[0, 24\)"),
             (dict(bad_words_token_ids=[[t] for t in range(24)]), "every token of the vocabulary"),
             (dict(bad_words_token_ids=[[4], [1, 5]], allowed_token_ids=[4, 5]), "every token of allowed_token_ids"),
             (dict(bad_words_token_ids=[[4]], allowed_token_ids=[4, 5], min_tokens=1, stop_token_ids=[5]),
              "every token of allowed_token_ids")]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([[1, 2]], SamplingParams(max_tokens=4, **kw))
    ok = llm.generate([[1, 2]], SamplingParams(max_tokens=4, bad_words_token_ids=[[4], [1, 5]],
                                               allowed_token_ids=[4, 5, 6]))  # 6 is never refused
    assert set(ok[0].token_ids) <= {5, 6}
