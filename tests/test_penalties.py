"""Repetition penalties (presence, frequency, repetition: eyas.layers.penalties). Plain decoding with
`repetition_penalty` equals HF transformers' `generate` (the oracle); with every penalty it equals a dense loop that
penalises each step's logits from scratch; speculative decoding equals plain decoding token for token (its tree
nodes penalised by their own paths); and at temperature 1 the joint law of the first tokens matches the penalised
law enumerated from the target (tests/test_spec_distribution.py's harness)."""
import numpy as np
import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.layers.penalties import penalize
from helpers import write_mirror_and_random, write_random_draft

SPECS = ["chain:4", "tree:mc_sim_7b_63", "dyn:k3d4n8"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_mirror_and_random(tmp_path_factory)


def _prompts():
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, 24, (n,), generator=g).tolist() for n in (1, 4, 9, 16)]


def test_penalize_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    seen = torch.tensor([[True, True, True, False]])  # token 2 in the prompt only
    penalize(logits, counts, seen, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0]))
    # token 0: 2 / 2 - 0.5 * 2 - 0.25; token 1: -1 * 2 - 0.5 - 0.25; token 2: 0.5 / 2; token 3 untouched
    torch.testing.assert_close(logits, torch.tensor([[-0.25, -2.75, 0.25, 3.0]]))
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])  # a logit bias goes first: token 2 turns negative, then doubles
    penalize(logits, counts, seen, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0]),
             torch.tensor([[0.0, 0.0, -1.5, 1.0]]))
    torch.testing.assert_close(logits, torch.tensor([[-0.25, -2.75, -2.0, 4.0]]))


def test_static_buffers_filled_from_fewer_rows_penalise_those_rows_only():
    """A graph's static penalties (`Penalties.neutral`, then `fill` from a step's rows): its first rows penalise as
    the step's own penalties do, its padding rows (filled after a batch that had more rows) change nothing."""
    from types import SimpleNamespace
    V = 6
    seq = lambda prompt, out, **kw: SimpleNamespace(  # noqa: E731
        token_ids=prompt + out, output_ids=out, params=SamplingParams(**kw))
    wide = [seq([1], [2, 2], frequency_penalty=0.5)] * 3
    step = [seq([0, 3], [3, 5], repetition_penalty=2.0, presence_penalty=0.25), seq([4], [1], frequency_penalty=1.0)]
    want, logits = filled_from_fewer_rows(wide, step, V, [0, 2, 3])
    assert not torch.equal(want, logits[:2])


def filled_from_fewer_rows(wide, step, V, node_tokens, words=False):
    """Static buffers of 4 rows (`Penalties.neutral`) filled from `wide`'s 3 rows, then `step`'s 2: their tree
    penalties equal `step`'s own penalties' in the first rows and change nothing in the others. Returns (step's
    own penalised logits, the logits before)."""
    from eyas.layers.penalties import Penalties
    buf = Penalties.neutral(4, V, "cpu", words=words)
    buf.fill(Penalties.of(wide, V, "cpu"))
    buf.fill(Penalties.of(step, V, "cpu"))
    logits = torch.randn(4, 3, V, generator=torch.Generator().manual_seed(0))
    tokens, anc = torch.tensor([node_tokens] * 4), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    got = logits.clone()
    buf.apply_to_tree(got, tokens, anc)
    want = logits[:2].clone()
    Penalties.of(step, V, "cpu").apply_to_tree(want, tokens[:2], anc)
    torch.testing.assert_close(got[:2], want)
    torch.testing.assert_close(got[2:], logits[2:])
    return want, logits


def test_node_penalties_equal_a_loop_over_each_nodes_path():
    """`apply_to_nodes` (a draft level's logits: shared node tokens or each node's own path, paths per row, a draft
    vocabulary's columns without some path tokens, a logit bias) equals penalising each node's logits from counts
    made by hand: the committed output plus its path."""
    from types import SimpleNamespace
    from eyas.layers.penalties import Penalties
    g = torch.Generator().manual_seed(3)
    V, B, L, M = 11, 3, 4, 5
    seqs = [SimpleNamespace(token_ids=[1, 2, 2, 7], output_ids=[2, 7], params=SamplingParams(
                frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.7, logit_bias={2: 1.5, 4: -2.0})),
            SimpleNamespace(token_ids=[3], output_ids=[], params=SamplingParams()),
            SimpleNamespace(token_ids=[4, 9, 9, 9], output_ids=[9, 9], params=SamplingParams(frequency_penalty=1.0))]
    pen = Penalties.of(seqs, V, "cpu")
    columns = torch.tensor([0, 2, 3, 7, 9, 10])
    for shared, per_row in ((True, False), (False, False), (False, True)):
        tokens = torch.randint(0, V, (B, M) if shared else (B, L, M), generator=g)
        on_path = torch.rand((B, L, M) if per_row else (L, M), generator=g) < 0.5
        for cols in (None, columns):
            K = V if cols is None else len(cols)
            logits = torch.randn(B, L, K, generator=g)
            got = logits.clone()
            pen.apply_to_nodes(got, tokens, on_path, cols)
            want = logits.clone()
            for b, s in enumerate(seqs):
                for j in range(L):
                    counts = torch.zeros(V)
                    for t in s.output_ids:
                        counts[t] += 1
                    for a in range(M):
                        if (on_path[b, j, a] if per_row else on_path[j, a]):
                            counts[tokens[b, a] if shared else tokens[b, j, a]] += 1
                    seen = counts > 0
                    seen[s.token_ids] = True
                    p = s.params
                    idx = torch.arange(V) if cols is None else cols
                    row = want[b, j][None]
                    bias = torch.zeros(V)
                    for t, v in (p.logit_bias or {}).items():
                        bias[t] = v
                    penalize(row, counts[idx][None], seen[idx][None], torch.tensor([p.frequency_penalty]),
                             torch.tensor([p.presence_penalty]), torch.tensor([p.repetition_penalty]), bias[idx][None])
                    want[b, j] = row[0]
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("spec", SPECS)
def test_the_draft_proposes_from_penalised_logits(pairs, spec):
    """With penalties the draft proposes from logits penalised as the target's will be after each node's path: the
    mirror draft (nearly the target) then keeps more of its acceptance than when it proposes without them
    (`PENALISE_DRAFT` off), and the output is the same either way."""
    import eyas.spec.step as step
    target, draft = pairs["mirror"]
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec)
    params = SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.6, frequency_penalty=0.3)
    runs = {}
    try:
        for on in (False, True):
            step.PENALISE_DRAFT = on
            outs = llm.generate(_prompts(), params)
            runs[on] = ([o.token_ids for o in outs],
                        sum(len(o.token_ids) for o in outs) / sum(o.stats.target_calls for o in outs))
    finally:
        step.PENALISE_DRAFT = True
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > 1.08 * runs[False][1], runs


@pytest.mark.parametrize("spec", ["chain:4", "tree:mc_sim_7b_63"])
def test_each_draft_level_counts_its_nodes_paths(pairs, spec, monkeypatch):
    """At every level of a static tree, the draft's logits for node j are penalised by the tokens of the nodes from
    the root's child down to j (found here by walking the tree's parents), as they stand in the drafted tree."""
    import eyas.spec.step as step
    from eyas.layers.penalties import Penalties
    target, draft = pairs["mirror"]
    calls, drafted = [], []
    for_draft = Penalties.for_draft

    def recording(self, path_tokens, on_path):
        calls.append((path_tokens.clone(), on_path.clone()))
        return for_draft(self, path_tokens, on_path)
    draft_phase = step.draft_phase

    def recorded_phase(*a, **k):
        d = draft_phase(*a, **k)
        drafted.append((len(calls), d.node_tokens.clone(), d.tree))
        return d
    monkeypatch.setattr(Penalties, "for_draft", recording)
    monkeypatch.setattr(step, "draft_phase", recorded_phase)
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(pairs["mirror"][1]), speculation=spec)
    llm.generate(_prompts(), SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=1.0))
    assert drafted
    start = 0
    for end, node_tokens, tree in drafted:
        levels = calls[start:end]
        assert len(levels) == tree.max_depth
        parents = tree.parents.tolist()
        for d, (tokens, on_path) in enumerate(levels):
            for li, j in enumerate(tree.levels[d]):
                path, a = [], j
                while a > 0:
                    path.append(a)
                    a = parents[a]
                for b in range(node_tokens.shape[0]):
                    counted = sorted(tokens[b, on_path[li]].tolist())
                    assert counted == sorted(node_tokens[b, path].tolist()), (spec, d, j)
        start = end


def test_dynamic_tree_beams_count_their_paths(pairs, monkeypatch):
    """A dynamic tree's beams: the root's candidates are penalised by the committed tokens alone, a depth-d beam's
    by d path tokens, whose first d - 1 are the path of a beam of the depth before."""
    from eyas.layers.penalties import Penalties
    target, draft = pairs["mirror"]
    calls = []
    for_draft = Penalties.for_draft

    def recording(self, path_tokens, on_path):
        calls.append((path_tokens.clone(), on_path.clone()))
        return for_draft(self, path_tokens, on_path)
    monkeypatch.setattr(Penalties, "for_draft", recording)
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="dyn:k3d4n8")
    llm.generate(_prompts()[:2], SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=1.0))
    assert calls and len(calls) % 4 == 0  # per step: the root, then depths 1-3
    for i in range(0, len(calls), 4):
        root, *beams = calls[i: i + 4]
        assert root[0].shape[-1] == 0
        prev = None
        for d, (tokens, on_path) in enumerate(beams, start=1):
            assert tokens.shape[-1] == d and bool(on_path.all())
            if prev is not None:
                for b in range(tokens.shape[0]):
                    for k in range(tokens.shape[1]):
                        assert tokens[b, k, :-1].tolist() in prev[b].tolist()
            prev = tokens


def test_repetition_penalty_equals_hf_generate(pairs):
    from transformers import LlamaForCausalLM
    target = pairs["mirror"][0]
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: 20 tokens whatever they are
    outs = LLM(str(target), device="cpu", dtype="float32").generate(
        _prompts(), SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.8))
    for p, o in zip(_prompts(), outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, repetition_penalty=1.8,
                          pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == ref


PARAMS = [dict(frequency_penalty=0.7), dict(presence_penalty=1.1), dict(repetition_penalty=1.6),
          dict(frequency_penalty=0.4, presence_penalty=-0.3, repetition_penalty=1.3),
          dict(logit_bias={3: 2.5, 7: -100.0, 11: 1.0}), dict(logit_bias={5: 3.0}, repetition_penalty=1.4),
          dict(allowed_token_ids=[2, 5, 9, 13, 17], logit_bias={5: -1.0, 20: 5.0}, repetition_penalty=1.3)]


def _bias(pen: dict, vocab: int, dtype=torch.float32) -> torch.Tensor | None:
    if not pen.get("logit_bias"):
        return None
    b = torch.zeros(1, vocab, dtype=dtype)
    for t, x in pen["logit_bias"].items():
        b[0, t] = x
    return b


def _allow(logits: torch.Tensor, pen: dict) -> None:
    """allowed_token_ids: every other token's logit -inf."""
    if pen.get("allowed_token_ids") is not None:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        keep[pen["allowed_token_ids"]] = True
        logits[..., ~keep] = float("-inf")


def _ban_words(logits: torch.Tensor, out: list, pen: dict) -> None:
    """bad_words_token_ids, read as vLLM defines them: a word's last token is refused where the output's last tokens
    are its others."""
    for w in pen.get("bad_words_token_ids") or []:
        k = len(w) - 1
        if k <= len(out) and list(out[len(out) - k:]) == list(w[:-1]):
            logits[..., w[-1]] = float("-inf")


def pair_llm(pairs, spec, pair="mirror"):
    """An LLM of a test pair's target (float32, blocks of 4), speculating with its draft where `spec` is given."""
    target, draft = pairs[pair]
    kw = dict(device="cpu", dtype="float32", block_size=4)
    if spec is not None:
        kw.update(draft=str(draft), speculation=spec)
    return LLM(str(target), **kw)


def _dense_greedy(target, prompt, n, ban=None, **pen):
    """Greedy decoding by dense forwards, each step's logits penalised from scratch (and held to allowed_token_ids
    and bad words); `ban` (tokens, k): those tokens refused at the first k output positions (min_tokens)."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = target.compute_logits(target(torch.tensor([ids]), torch.arange(len(ids))[None]))[0, -1:].clone()
        out = ids[len(prompt):]
        counts = torch.zeros(1, logits.shape[-1])
        for t in out:
            counts[0, t] += 1
        seen = torch.zeros(1, logits.shape[-1], dtype=torch.bool)
        seen[0, ids] = True
        penalize(logits, counts, seen, torch.tensor([pen.get("frequency_penalty", 0.0)]),
                 torch.tensor([pen.get("presence_penalty", 0.0)]), torch.tensor([pen.get("repetition_penalty", 1.0)]),
                 _bias(pen, logits.shape[-1]))
        _allow(logits, pen)
        _ban_words(logits, out, pen)
        if ban is not None and len(out) < ban[1]:
            logits[0, ban[0]] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("pair", ["mirror", "random"])
@pytest.mark.parametrize("spec", [None] + SPECS)
def test_greedy_with_penalties_equals_a_dense_loop(pairs, pair, spec):
    llm = pair_llm(pairs, spec, pair)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **pen) for pen in PARAMS]
    prompts = (_prompts() * 2)[:len(PARAMS)]
    outs = llm.generate(prompts, params)
    for p, o, pen in zip(prompts, outs, PARAMS, strict=True):
        assert o.token_ids == _dense_greedy(llm.target, p, 24, **pen), pen
        assert 7 not in o.token_ids or -100.0 not in (pen.get("logit_bias") or {}).values()  # banned
        assert set(o.token_ids) <= set(pen.get("allowed_token_ids") or range(24))
    plain = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert all(a.token_ids != b.token_ids for a, b in zip(outs, plain))  # the penalties changed every output
    if spec is not None and pair == "mirror":  # paths were accepted, so the tree's own penalties were used
        assert sum(o.stats.committed for o in outs) > 1.3 * sum(o.stats.target_calls for o in outs)


@pytest.mark.parametrize("setting", [dict(max_num_seqs=2), dict(num_blocks=30)], ids=["slots_reused", "preempt"])
def test_penalty_rows_follow_slots_through_reuse_and_preemption(pairs, setting):
    """The penalties' per-slot device rows (`PenaltyState`): requests with and without penalties take turns in two
    slots, or are preempted and prefilled again, and each output still equals the dense loop's (penalised from
    scratch every step) or, without penalties, plain greedy decoding's: a slot's row is made again for each new
    request, a request without penalties gets neutral coefficients in a slot a penalised one left, and no step
    counts a token twice."""
    target, draft = pairs["mirror"]
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=4, draft=str(draft), speculation="chain:4",
              **setting)
    pens = [PARAMS[0], {}, PARAMS[3], PARAMS[5], {}, PARAMS[2], PARAMS[4], {}]
    prompts = (_prompts() * 2)[:len(pens)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=24, ignore_eos=True, **pen) for pen in pens])
    for p, o, pen in zip(prompts, outs, pens, strict=True):
        assert o.token_ids == _dense_greedy(llm.target, p, 24, **pen), pen
    state = llm.engine.runner.penalty_state
    if "num_blocks" in setting:
        assert llm.engine.scheduler.num_preemptions > 0
    else:  # each request's row made once (the steps after count on the device), the rows of those without
        assert state.rows_made == len(pens)  # penalties included (neutral coefficients)


@pytest.mark.parametrize("spec", [None] + SPECS)
def test_min_tokens_equals_a_dense_loop_that_bans_stop_tokens(pairs, spec):
    """vLLM's `min_tokens`: a stop token (here `stop_token_ids`, the tokens plain decoding would stop at early) is
    refused at every position before min_tokens, each tree node by its own position (its path's length), and may end
    the output after: greedy output and finish reason equal a dense loop that bans them so. With penalties beside it
    and without; a request without min_tokens in the same batch stops early as before."""
    llm = pair_llm(pairs, spec)
    prompts = _prompts()
    free = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    cases = []
    for p, o in zip(prompts, free):
        stops = sorted(set(o.token_ids[:3]))  # tokens it meets early (the first: prefill's), where it would stop
        for pen in ({}, PARAMS[3]):
            cases.append((p, stops, pen))
    params = [SamplingParams(max_tokens=30, ignore_eos=True, min_tokens=12, stop_token_ids=st, **pen)
              for _, st, pen in cases]
    outs = llm.generate([c[0] for c in cases] + [prompts[0]],
                        params + [SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=cases[0][1])])
    for (p, stops, pen), o in zip(cases, outs, strict=False):
        want = _dense_greedy(llm.target, p, 30, ban=(stops, 12), **pen)
        end = next((i for i, t in enumerate(want) if t in stops), None)
        assert end is None or end >= 12
        want = want if end is None else want[: end + 1]
        assert o.token_ids == want, (stops, pen)
        assert o.finish_reason == ("length" if end is None else "stop")
    assert len(outs[-1].token_ids) <= 4 and outs[-1].finish_reason == "stop"
    assert any(o.finish_reason == "stop" for o in outs[:-1])  # some stopped after min_tokens


@pytest.mark.parametrize("spec", ["chain:4", "dyn:k3d4n8"])
def test_allowed_tokens_outside_the_drafts_vocabulary(pairs, spec, tmp_path, monkeypatch):
    """allowed_token_ids that a reduced draft vocabulary does not hold: every draft proposal is ruled out (its
    logits all -inf, kept finite so that a dynamic tree's scores are not NaN), and the output still equals the dense
    loop's under allowed_token_ids, greedy; sampled, seeded, it equals plain decoding's law's support. The engine
    refuses ids beyond the vocabulary, and min_tokens when every allowed token stops the output."""
    import shutil

    from eyas.spec.draft_vocab import save_draft_vocab
    target, draft = pairs["mirror"]
    small = tmp_path / "draft"
    shutil.copytree(draft, small)
    save_draft_vocab(small, torch.arange(12))
    allowed = [14, 17, 19, 22]
    import eyas.spec.dynamic_tree as dt
    scores, topk_logp = [], dt.draft_topk_logp

    def spy(*a, **k):
        logp, ids = topk_logp(*a, **k)
        scores.append(logp)
        return logp, ids

    monkeypatch.setattr(dt, "draft_topk_logp", spy)
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=4, draft=str(small), speculation=spec)
    pen = dict(allowed_token_ids=allowed, frequency_penalty=0.5)
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=16, ignore_eos=True, **pen))
    for p, o in zip(_prompts(), outs):
        assert o.token_ids == _dense_greedy(llm.target, p, 16, **pen)
    assert (len(scores) > 0) == spec.startswith("dyn") and not any(x.isnan().any() for x in scores)
    sampled = llm.generate(_prompts(), SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=3,
                                                      **pen))
    assert all(set(o.token_ids) <= set(allowed) and len(o.token_ids) == 16 for o in sampled)
    with pytest.raises(ValueError, match="allowed_token_ids must be token ids in"):
        llm.generate(_prompts()[:1], SamplingParams(allowed_token_ids=[3, 24]))
    with pytest.raises(ValueError, match="min_tokens: every one of allowed_token_ids"):
        llm.generate(_prompts()[:1], SamplingParams(allowed_token_ids=[3], stop_token_ids=[3], min_tokens=2))


def test_bad_penalties_are_refused():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0),
                dict(repetition_penalty=-1.0), dict(presence_penalty="1")):
        with pytest.raises(ValueError, match="penalty"):
            SamplingParams(**bad)
    for bad in ({-1: 1.0}, {"3": 1.0}, {3: 101.0}, {3: "x"}, [3]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    from eyas.sampling_params import GuidedDecoding
    for bad in ([], [-1], ["3"], [True], 3, dict(guided=GuidedDecoding(regex="a+"))):
        kw = dict(allowed_token_ids=[3], **bad) if isinstance(bad, dict) else dict(allowed_token_ids=bad)
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(**kw)
    assert SamplingParams(allowed_token_ids=(5, 3, 5)).allowed_token_ids == [3, 5]
    for bad in (dict(min_tokens=-1), dict(min_tokens=17), dict(min_tokens=True),
                dict(min_tokens=2, guided=GuidedDecoding(regex="a+"))):
        with pytest.raises(ValueError, match="min_tokens"):
            SamplingParams(max_tokens=16, **bad)


# ---- the law at temperature 1, enumerated -------------------------------------------------------------------------

V = 6
PROMPT = [1, 4, 2]
RUNS = 12_000
PEN = dict(frequency_penalty=0.6, presence_penalty=0.3, repetition_penalty=1.5, logit_bias={1: 1.5, 2: -2.0})


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from helpers import write_tiny_llama
    d = tmp_path_factory.mktemp("dist")
    target = write_tiny_llama(d / "t", vocab=V, hidden=32, heads=4, kv_heads=2, layers=2, seed=5)
    return target, write_random_draft(d / "rd", target, seed=2, scale=1.0)


def _law(hf, prefix, pen):
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:].double()
    counts = torch.zeros(1, V, dtype=torch.float64)
    for t in prefix:
        counts[0, t] += 1
    seen = torch.zeros(1, V, dtype=torch.bool)
    seen[0, PROMPT + list(prefix)] = True
    penalize(logits, counts, seen, torch.tensor([pen.get("frequency_penalty", 0.0)]),
             torch.tensor([pen.get("presence_penalty", 0.0)]), torch.tensor([pen.get("repetition_penalty", 1.0)]),
             _bias(pen, V, torch.float64))
    _allow(logits, pen)
    _ban_words(logits, list(prefix), pen)
    if len(prefix) < pen.get("min_tokens", 0):  # min_tokens: the stop tokens refused before it
        logits[0, pen["stop_token_ids"]] = float("-inf")
    return torch.softmax(logits[0], -1).numpy()


def _joint(hf, pen):
    p1 = _law(hf, (), pen)
    return {(a, b): p1[a] * _law(hf, (a,), pen)[b] for a in range(V) for b in range(V)}


def _pvalue(observed: dict, joint: dict) -> float:
    from scipy.stats import chisquare
    keys = sorted(joint)
    expected = np.array([joint[k] for k in keys]) * RUNS
    obs = np.array([observed.get(k, 0) for k in keys])
    big = expected >= 5  # pool the rare cells
    return chisquare(np.append(obs[big], obs[~big].sum()), np.append(expected[big], expected[~big].sum())).pvalue


@pytest.mark.parametrize("pen", [PEN, dict(PEN, min_tokens=1, stop_token_ids=[1]),
                                 dict(PEN, allowed_token_ids=[0, 1, 3, 4]),
                                 dict(PEN, bad_words_token_ids=[[3], [1, 1], [0, 4]])],
                         ids=["penalties", "min_tokens", "allowed", "bad_words"])
@pytest.mark.parametrize("spec", ["chain:2", "tree:8"])
def test_joint_law_with_penalties(small, spec, pen):
    from transformers import LlamaForCausalLM
    target, draft = small
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec, max_num_seqs=256)
    outs = llm.generate([PROMPT] * RUNS, [SamplingParams(temperature=1.0, max_tokens=2, seed=s, ignore_eos=True,
                                                         **pen) for s in range(RUNS)])
    observed = {}
    for o in outs:
        observed[tuple(o.token_ids)] = observed.get(tuple(o.token_ids), 0) + 1
    if "min_tokens" in pen:  # token 1 (likely: biased up) refused first, allowed second
        assert not any(k[0] == 1 for k in observed) and any(k[1] == 1 for k in observed)
    if "allowed_token_ids" in pen:
        assert {t for k in observed for t in k} == set(pen["allowed_token_ids"])
    if "bad_words_token_ids" in pen:  # 3 never; 1 and 4 first, but not after 1 and 0 respectively
        assert not any(3 in k or k in ((1, 1), (0, 4)) for k in observed)
        assert any(k[0] == 1 for k in observed) and any(k[1] == 4 for k in observed)
    assert _pvalue(observed, _joint(hf, pen)) > 1e-3
    assert _pvalue(observed, _joint(hf, {})) < 1e-6  # the unpenalised law is far from it: the test has power
