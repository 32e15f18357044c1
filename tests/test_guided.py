"""Guided decoding (eyas.spec.grammar): the grammar state follows the speculative tree.

Oracles: xgrammar's matcher fed the whole history afresh (for the tree's masks and the committed state), plain
guided decoding (for speculative guided decoding, token for token), Python's `re` and `json` (for what the output
matches), and the law enumerated exactly from HF transformers' forward with the grammar's masks (temperature 1)."""
import json
import re

import numpy as np
import pytest
import torch

from eyas import LLM, GuidedDecoding, SamplingParams
from eyas.spec.grammar import GrammarBackend, allowed_tokens, apply_bitmask, choice_grammar, tree_bitmask_reference
from helpers import SEP, tiny_tokenizer, write_guided_mirror

@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    return write_guided_mirror(tmp_path_factory.mktemp("guided"))


@pytest.fixture(scope="module")
def backend():
    tok = tiny_tokenizer()
    return GrammarBackend(tok, tok.vocab_size + 5, [tok.eos_token_id]), tok  # a head wider than the vocabulary


def allowed_set(state_or_matcher, words, V):
    m = getattr(state_or_matcher, "matcher", state_or_matcher)
    mask = torch.zeros(1, words, dtype=torch.int32)
    m.fill_next_token_bitmask(mask, 0)
    return set(torch.nonzero(allowed_tokens(mask, V)[0]).flatten().tolist())


def fresh_mask(be, compiled, history, words):
    """The oracle: a new matcher fed `history` from the start (None if it refuses a token or has terminated)."""
    import xgrammar as xgr
    m = xgr.GrammarMatcher(compiled, override_stop_tokens=be.stop_ids)
    for t in history:
        if m.is_terminated() or not m.accept_token(t):
            return None
    if m.is_terminated():
        return None
    out = torch.zeros(1, words, dtype=torch.int32)
    m.fill_next_token_bitmask(out, 0)
    return out[0]


A_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# structural tags (vLLM's response_format of that type): a tag whose content follows a schema, in xgrammar's format,
# and vLLM's older form (free text, a trigger opening the tag)
TAG = {"format": {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": A_SCHEMA},
                  "end": "</f>"}}
TRIGGERED = {"structures": [{"begin": "<f>", "schema": A_SCHEMA, "end": "</f>"}], "triggers": ["<f"]}
GUIDES = [GuidedDecoding(regex=r"(yes|no), [0-9]{1,3}!"), GuidedDecoding(choice=["a", "ab", "abc", "ba"]),
          GuidedDecoding(json=A_SCHEMA), GuidedDecoding(grammar='root ::= ("ab" | "c")+ "."'),
          GuidedDecoding(structural_tag=TAG)]


@pytest.mark.parametrize("g", GUIDES, ids=lambda g: g.kind)
def test_tree_masks_follow_each_path(backend, g):
    """Every node's mask is the state its path reaches from the committed history: xgrammar's tree walk equals the
    plain walk (forks of the matcher), and both equal a fresh matcher fed history + path; nodes under a refused
    token or past a complete grammar allow everything. The matcher is unchanged afterwards."""
    be, tok = backend
    V = be.vocab_size
    rng = np.random.default_rng(0)
    for trial in range(12):
        state = be.state(g)
        compiled = be.compile(g)
        history = []
        for _ in range(int(rng.integers(0, 3))):  # commit a few allowed tokens first
            allowed = sorted(allowed_set(state, be.words, V) - set(be.stop_ids))
            if not allowed:
                break
            t = int(rng.choice(allowed))
            assert state.accept([t]) == 1
            history.append(t)
        N1 = int(rng.integers(2, 14))
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, N1)])
        tokens = np.zeros(N1, dtype=np.int64)
        for i in range(1, N1):  # mostly tokens the grammar allows after the parent's path, sometimes any (refused)
            path, j = [], parents[i]
            while j > 0:
                path.append(int(tokens[j]))
                j = parents[j]
            ref = fresh_mask(be, compiled, history + path[::-1], be.words)
            ok = [] if ref is None else torch.nonzero(allowed_tokens(ref, V)).flatten().tolist()
            tokens[i] = int(rng.choice(ok)) if ok and rng.random() < 0.8 else int(rng.integers(0, V))
        before = allowed_set(state, be.words, V)
        fast = torch.zeros(N1, be.words, dtype=torch.int32)
        plain = torch.zeros(N1, be.words, dtype=torch.int32)
        state.tree_bitmask(tokens, parents, fast)
        tree_bitmask_reference(state, tokens, parents, plain)
        assert torch.equal(fast, plain), trial
        assert allowed_set(state, be.words, V) == before
        for i in range(N1):
            path, j = [], i
            while j > 0:
                path.append(int(tokens[j]))
                j = parents[j]
            ref = fresh_mask(be, compiled, history + path[::-1], be.words)
            expect = torch.full((be.words,), -1, dtype=torch.int32) if ref is None else ref
            assert torch.equal(fast[i], expect), (trial, i)


def test_special_tokens_are_never_allowed_but_the_stop_token(backend):
    """A special token's literal text fits a JSON string or `[a-z<|>]*`, but the detokenizer drops it: never allowed
    (the stop token only where the grammar may end)."""
    be, tok = backend
    sep, end = tok.backend.token_to_id(SEP), tok.eos_token_id
    for g, prefix in ((GuidedDecoding(regex=r"[a-z<|>]{0,30}"), ""),
                      (GuidedDecoding(json={"type": "object", "properties": {"a": {"type": "string"}}}), '{"a": "x')):
        st = be.state(g)
        st.accept(tok.encode(prefix))
        allowed = allowed_set(st, be.words, be.vocab_size)
        assert tok.encode("<")[0] in allowed and sep not in allowed
        assert (end in allowed) == (g.regex is not None)


def test_apply_bitmask_against_a_loop():
    torch.manual_seed(0)
    V, words = 70, 3
    logits = torch.randn(2, 4, V)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 4, words), dtype=torch.int32)
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    for idx in np.ndindex(2, 4):
        for t in range(V):
            on = (int(bitmask[idx][t // 32]) >> (t % 32)) & 1
            assert masked[idx][t] == (logits[idx][t] if on else float("-inf"))


def test_choice_grammar_escapes():
    assert choice_grammar(['a"b', "c\\d", "é"]) == 'root ::= "a\\"b" | "c\\\\d" | "é"'


def test_bad_specs_are_value_errors(backend):
    be, _ = backend
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecoding(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecoding()
    with pytest.raises(ValueError, match="non-empty list"):
        GuidedDecoding(choice=[])
    with pytest.raises(ValueError, match="guided json"):
        GuidedDecoding(json=3)
    with pytest.raises(ValueError, match="invalid regex"):
        be.compile(GuidedDecoding(regex="a("))
    with pytest.raises(ValueError, match="invalid json"):
        be.compile(GuidedDecoding(json={"type": "objec"}))
    with pytest.raises(ValueError, match="invalid grammar"):
        be.compile(GuidedDecoding(grammar="root ::= ("))
    with pytest.raises(ValueError, match="GuidedDecoding"):
        SamplingParams(guided={"regex": "a"})
    for bad in ({}, {"format": {}, "structures": []}, "<f>"):
        with pytest.raises(ValueError, match="guided structural_tag"):
            GuidedDecoding(structural_tag=bad)
    for bad, words in (({"format": {"type": "nope"}}, ".*Format type not recognized: nope"),
                       ({"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": []}, "missing field 'schema'")):
        with pytest.raises(ValueError, match=f"invalid structural_tag: {words}"):
            be.compile(GuidedDecoding(structural_tag=bad))
    # xgrammar's "Check failed: (...) is false:" prefix is not the client's business
    with pytest.raises(ValueError, match=r"invalid json: Failed to parse JSON: syntax error"):
        be.compile(GuidedDecoding(json="{bad"))


XGRAMMAR_FAULT = "[12:00:00] /project/cpp/grammar_compiler.cc:99: Check failed: (ok) is false: out of memory"


def _raise(msg):
    def f(*args, **kwargs):
        raise RuntimeError(msg)
    return f


def test_xgrammar_faults_are_not_blamed_on_the_spec(backend, monkeypatch):
    """Only the errors of xgrammar's schema, regex and EBNF front ends (and its structural-tag check) are the
    client's: any other RuntimeError stays one, so that the server answers 500 instead of a 400 that blames a sound
    spec."""
    be, _ = backend
    monkeypatch.setattr(be.compiler, "compile_regex", _raise(XGRAMMAR_FAULT))
    with pytest.raises(RuntimeError, match="xgrammar failed to compile a regex: .*out of memory") as e:
        be.compile(GuidedDecoding(regex="a"))
    assert not isinstance(e.value, ValueError)
    monkeypatch.setattr(be.compiler, "compile_regex",
                        _raise("[12:00:00] /project/cpp/regex_converter.cc:94: Regex parsing error at position 3"))
    with pytest.raises(ValueError, match="invalid regex: Regex parsing error at position 3$"):
        be.compile(GuidedDecoding(regex="a"))


def matches(g: GuidedDecoding, text: str) -> bool:
    if g.regex is not None:
        return re.fullmatch(g.regex, text) is not None
    if g.choice is not None:
        return text in g.choice
    if g.grammar is not None:
        return re.fullmatch(r"(ab|c)+\.", text) is not None
    if g.structural_tag is not None:  # the tag's content (every tag's, after a trigger) is the schema's
        parts = [text] if "format" in g.structural_tag else text.split("<f")[1:]
        for p in parts:
            m = re.fullmatch(r"<f>(.*)</f>", p if "format" in g.structural_tag else "<f" + p, re.S)
            if m is None or not isinstance(json.loads(m.group(1)).get("a"), int):
                return False
        return True
    obj = json.loads(text)
    return isinstance(obj, dict) and (g.json is None or isinstance(obj.get("a"), int))


PROMPTS = ["Hello there", "yes or no?", "{\"", "abcabc", "12 12 12"]


@pytest.mark.parametrize("spec", ["chain:3", "tree:8", "dyn:k4d3n8"])
def test_speculative_guided_equals_plain_guided(mirror, spec):
    """Greedy guided output with speculation equals plain guided output token for token, for every kind of
    guide, batched with an unguided request; each guided output matches its guide, and drafts were accepted."""
    target, draft, _ = mirror
    plain = LLM(str(target), device="cpu", dtype="float32")
    fast = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec)
    guides = GUIDES + [GuidedDecoding(json_object=True), GuidedDecoding(regex=r"[a-z ]{5,60}\."),
                       GuidedDecoding(structural_tag=TRIGGERED), None]
    params = [SamplingParams(max_tokens=40, guided=g) for g in guides]
    accepted = 0
    for prompt in PROMPTS[:3]:
        a = plain.generate([prompt] * len(guides), params)
        b = fast.generate([prompt] * len(guides), params)
        for g, x, y in zip(guides, a, b):
            assert x.token_ids == y.token_ids, (prompt, g)
            if g is not None and x.finish_reason == "stop":
                assert matches(g, x.text), (g, x.text)
        accepted += sum(sum(o.stats.accepted_by_depth) for o, g in zip(b, guides) if g is not None)
    assert accepted > 0


def test_padded_prefills_draw_a_guided_requests_first_token_from_its_grammar(mirror):
    """On a GPU every prefill runs at a padded shape and its step draws the first tokens from the logits as they are
    (`eyas.engine.prefill_graph.first_tokens`); a guided request's first token must come from the grammar's masked
    logits instead. An engine whose prefills are padded (`ModelRunner.pad_prefill`, here on the CPU) gives each
    guided request, prefilled alone, what one without padding gives, and each output matches its guide."""
    target, _, _ = mirror
    runs = {}
    for pad in (False, True):
        llm = LLM(str(target), device="cpu", dtype="float32")
        llm.engine.runner.pad_prefill = pad
        runs[pad] = [llm.generate([PROMPTS[1]], [SamplingParams(max_tokens=24, guided=g)])[0] for g in GUIDES]
    assert [o.token_ids for o in runs[True]] == [o.token_ids for o in runs[False]]
    assert all(matches(g, o.text) for g, o in zip(GUIDES, runs[True]) if o.finish_reason == "stop")


def test_restrict_logits_against_a_loop():
    """The draft's logits restricted to a grammar's tokens: over the whole vocabulary, and over a draft vocabulary
    (column j is token ids[j])."""
    from eyas.spec.draft_vocab import restrict_logits
    torch.manual_seed(0)
    V, words = 70, 3
    allowed = torch.randint(-2**31, 2**31 - 1, (2, words), dtype=torch.int32)
    on = [[(int(allowed[b, t // 32]) >> (t % 32)) & 1 for t in range(V)] for b in range(2)]
    for ids in (None, torch.tensor([3, 0, 69, 40, 41, 7])):
        draft = type("Draft", (), {"vocab_ids": ids})()
        K = V if ids is None else len(ids)
        logits = torch.randn(2, 3, K)
        got = restrict_logits(draft, logits, allowed)
        for b, i, j in np.ndindex(2, 3, K):
            t = j if ids is None else int(ids[j])
            assert got[b, i, j] == (logits[b, i, j] if on[b][t] else float("-inf"))
    # a row that allows none of the draft's tokens stays whole (all -inf would make NaN log-probabilities)
    only = torch.zeros(2, words, dtype=torch.int32)
    only[0, 1] = 1 << 3  # token 35 only, outside the draft vocabulary below; row 1 allows nothing at all
    draft = type("Draft", (), {"vocab_ids": torch.tensor([3, 0, 69])})()
    logits = torch.randn(2, 1, 3)
    assert torch.equal(restrict_logits(draft, logits, only), logits)


@pytest.mark.parametrize("spec", ["chain:3", "tree:8", "dyn:k4d3n8"])
@pytest.mark.parametrize("draft_vocab", [False, True])
def test_draft_proposes_the_roots_children_among_allowed_tokens(mirror, spec, draft_vocab, tmp_path):
    """Under a grammar the draft proposes the root's children among the tokens the grammar allows next (its deeper
    levels propose freely); with a draft vocabulary, among those of them it has; a top-k wider than what is allowed
    proposes every allowed token. The mirror draft, which follows the target's free argmax, proposed refused tokens
    there before."""
    import shutil
    from eyas.spec.draft_vocab import save_draft_vocab
    from eyas.spec.grammar import TreeGuide
    target, draft, tok = mirror
    ids = None
    if draft_vocab:
        ids = torch.arange(0, tok.vocab_size, 2)  # half the tokens
        shutil.copytree(draft, tmp_path / "d")
        draft = tmp_path / "d"
        save_draft_vocab(draft, ids)
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec)
    V = llm.target.config.vocab_size
    seen = []
    masks = TreeGuide.masks

    def spy(self, tokens, parents, out):
        r = masks(self, tokens, parents, out)
        for b, st in enumerate(self.states):
            if st is not None:
                par = parents if parents.ndim == 1 else parents[b]
                root = allowed_tokens(r[b, 0], V)  # the root's row: what the grammar allows next
                can = int(root.sum() if ids is None else root[ids].sum())  # allowed tokens the draft may propose
                kids = [bool(root[tokens[b][i]]) for i in range(1, len(par)) if par[i] == 0]
                seen.append(sum(kids) >= min(can, len(kids)))  # a top-k wider than the allowed set takes them all
        return r
    TreeGuide.masks = spy
    try:
        guides = [GuidedDecoding(regex=r"(yes|no), [0-9]{1,3}!"), GuidedDecoding(json_object=True),
                  GuidedDecoding(regex=r"[a-z ]{5,60}\."), None]
        llm.generate(["Hello there"] * 4, [SamplingParams(max_tokens=30, guided=g) for g in guides])
    finally:
        TreeGuide.masks = masks
    assert len(seen) > 20 and all(seen)


def test_grammar_state_is_the_committed_history(mirror):
    """After every speculative step (rejected branches included), each guided request's matcher allows exactly
    what a fresh matcher fed its committed output allows."""
    target, draft, tok = mirror
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="tree:8")
    engine = llm.engine
    g = GuidedDecoding(regex=r"[a-z ]{5,80}\.")
    seqs = [engine.add_request(p, SamplingParams(max_tokens=60, guided=g)) for p in PROMPTS]
    be = engine.grammar_backend()
    compiled = be.compile(g)
    steps = rejected = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        for s in seqs:
            if s.finished:
                continue
            ref = fresh_mask(be, compiled, s.output_ids, be.words)
            got = torch.zeros(1, be.words, dtype=torch.int32)
            s.grammar.fill(got, 0)
            assert torch.equal(got[0], ref), (steps, s.output_ids)
            rejected += s.stats.target_calls * engine.tree.max_depth - sum(s.stats.accepted_by_depth)
    assert rejected > 0 and steps > 3
    assert all(s.finish_reason in ("stop", "length") for s in seqs)
    assert engine.blocks.num_free == engine.blocks.num_usable  # no KV block leaked


def test_guided_requests_survive_preemption(mirror):
    """A KV pool too small for the batch preempts guided requests and prefills them again: their outputs equal a
    roomy engine's (speculative and plain), each grammar state holds exactly its committed output afterwards (the
    re-prefill feeds it nothing twice), and no block leaks."""
    target, draft, tok = mirror
    guides = [GuidedDecoding(regex=r"[a-z ]{5,60}\."), GuidedDecoding(json_object=True),
              GuidedDecoding(regex=r"(yes|no), [0-9]{1,3}!"), None, GuidedDecoding(regex=r"[a-c]{20,40}")]
    params = [SamplingParams(max_tokens=40, guided=g, temperature=t, seed=i)
              for i, (g, t) in enumerate(zip(guides * 2, [0.0] * 5 + [1.0] * 5))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    kw = dict(device="cpu", dtype="float32", draft=str(draft), speculation="tree:8")
    ref = [(o.token_ids, o.finish_reason) for o in LLM(str(target), **kw).generate(prompts, params)]
    tight = LLM(str(target), num_blocks=40, block_size=4, max_num_seqs=6, **kw)
    engine = tight.engine
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    be = engine.grammar_backend()
    while engine.has_unfinished():
        engine.step()
        for s in seqs:
            if s.grammar is not None and not s.finished:
                ref_mask = fresh_mask(be, be.compile(s.params.guided), s.output_ids, be.words)
                got = torch.zeros(1, be.words, dtype=torch.int32)
                s.grammar.fill(got, 0)
                assert torch.equal(got[0], ref_mask), s.request_id
    assert engine.scheduler.num_preemptions > 0
    assert [(s.output_ids, s.finish_reason) for s in seqs] == ref
    assert engine.blocks.num_used == 0


def test_grammar_completion_ends_the_output_even_with_ignore_eos(mirror):
    target, draft, tok = mirror
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="chain:3")
    g = GuidedDecoding(choice=["abc", "ba"])
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=30, guided=g, ignore_eos=True))
    for o in out:
        assert o.finish_reason == "stop" and o.text in ("abc", "ba")
        assert o.token_ids[-1] == tok.eos_token_id  # the grammar's stop token ends it, and is its last token


def test_engine_rejects_a_bad_schema_before_queueing(mirror):
    target, _, _ = mirror
    llm = LLM(str(target), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate(["x"], SamplingParams(guided=GuidedDecoding(regex="(")))
    assert not llm.engine.has_unfinished()


# ---- the law at temperature 1 -------------------------------------------------------------------------------------

RUNS = 20_000
LAW_GUIDE = GuidedDecoding(choice=["a", "ab", "abc", "b", "ba"])


def exact_guided_law(target_dir, tok, prompt, guide: GuidedDecoding = LAW_GUIDE, top_k: int | None = None,
                     max_tokens: int | None = None):
    """The law of the whole output (token paths, end token included) of plain guided sampling at temperature 1:
    each token drawn from HF transformers' next-token softmax (over its top k, with `top_k`) restricted to what a
    fresh matcher allows. A guide with `after_token_id` (a gate) allows every token until the path holds the gate,
    then what a fresh matcher fed the path after its first gate allows. `max_tokens` ends the paths that long."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    be = GrammarBackend(tok, hf.config.vocab_size, [tok.eos_token_id])
    compiled = be.compile(guide)
    gate = guide.after_token_id
    law = {}

    def walk(path, prob):
        mask = None
        if gate is None or gate in path:
            mask = fresh_mask(be, compiled, path if gate is None else path[path.index(gate) + 1:], be.words)
            if mask is None:  # terminated: the end token was the last one
                law[tuple(path)] = prob
                return
        if len(path) == max_tokens:
            law[tuple(path)] = prob
            return
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + path])).logits[0, -1].double()
        if mask is not None:
            logits[~allowed_tokens(mask, logits.shape[0])] = float("-inf")
        if top_k is not None:
            logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
        p = torch.softmax(logits, -1)
        for t in torch.nonzero(p > 0).flatten().tolist():
            walk(path + [t], prob * float(p[t]))

    walk([], 1.0)
    return law


def sampled_law_p(llm, prompt, params, law: dict):
    """Generate `prompt` once per params; every output must be a path of `law`: (the pooled chi-square p-value of
    the outputs' counts against it, the outputs)."""
    from test_spec_distribution import pooled_chisquare
    outs = llm.generate([prompt] * len(params), params)
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert set(counts) <= set(law), set(counts) - set(law)
    return pooled_chisquare(counts, law, len(params)), outs


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["chain:3", "tree:8"])
def test_guided_sampling_law_is_exact(mirror, spec, tmp_path):
    import shutil

    from eyas.spec.draft_vocab import save_draft_vocab
    target, mirror_draft, tok = mirror
    # the mirror draft restricted to the choices' tokens (a draft vocabulary), so that it proposes what the grammar
    # allows and paths are accepted: over the whole vocabulary its top tokens are none of them
    draft = tmp_path / "draft"
    shutil.copytree(mirror_draft, draft)
    words = sorted({t for c in ["a", "b", "ab", "abc", "ba"] for t in tok.encode(c)} | {tok.eos_token_id})
    save_draft_vocab(draft, torch.tensor(words))
    prompt = tok.encode("abab")
    law = exact_guided_law(target, tok, prompt)
    assert len(law) >= 8 and abs(sum(law.values()) - 1) < 1e-9
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec,
              max_num_seqs=1024, num_blocks=1024 * 4 + 8, block_size=4)
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=s, guided=LAW_GUIDE) for s in range(RUNS)]
    p, outs = sampled_law_p(llm, prompt, params, law)
    accepted = sum(sum(o.stats.accepted_by_depth) for o in outs)
    print(f"{spec}: {len(law)} outputs, chi-square p {p:.3f}, {accepted} draft tokens accepted")
    assert p > 1e-3, p
    assert accepted > 0


# ---- the server: OpenAI's response_format and vLLM's guided_* fields -------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def guided_server(mirror):
    from eyas.serve.api_server import create_app
    from test_server import LiveServer
    target, draft, _ = mirror
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="tree:8")
    g = SamplingParams(max_tokens=40)
    refs = {"schema": llm.chat([{"role": "user", "content": "json"}], _with(g, json=SCHEMA))[0],
            "object": llm.chat([{"role": "user", "content": "json"}], _with(g, json_object=True))[0],
            "regex": llm.generate(["yes?"], _with(g, regex=r"(yes|no), [0-9]{1,3}!"))[0],
            "choice": llm.generate(["pick"], _with(g, choice=["abc", "ba"]))[0],
            "tag": llm.chat([{"role": "user", "content": "json"}], _with(g, structural_tag=TAG))[0]}
    server = LiveServer(create_app(llm, "mirror"))
    server.refs = refs
    yield server
    server.close()


def _with(params: SamplingParams, **guided) -> SamplingParams:
    import dataclasses
    return dataclasses.replace(params, guided=GuidedDecoding(**guided))


def test_server_guided_outputs_equal_offline(guided_server):
    refs = guided_server.refs
    client = guided_server.client()
    msgs = [{"role": "user", "content": "json"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="mirror", messages=msgs, max_tokens=40, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].message.content == refs["schema"].text
    assert r.choices[0].finish_reason == refs["schema"].finish_reason
    if refs["schema"].finish_reason == "stop":
        assert set(json.loads(refs["schema"].text)) == {"a", "b"}
    chunks = client.chat.completions.create(model="mirror", messages=msgs, max_tokens=40, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == refs["schema"].text
    r = client.chat.completions.create(model="mirror", messages=msgs, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content == refs["object"].text
    r = client.completions.create(model="mirror", prompt="yes?", max_tokens=40, temperature=0,
                                  extra_body={"guided_regex": r"(yes|no), [0-9]{1,3}!"})
    assert r.choices[0].text == refs["regex"].text and re.fullmatch(r"(yes|no), [0-9]{1,3}!", r.choices[0].text)
    r = client.completions.create(model="mirror", prompt="pick", max_tokens=40, temperature=0,
                                  extra_body={"guided_choice": ["abc", "ba"]})
    assert r.choices[0].text == refs["choice"].text and r.choices[0].text in ("abc", "ba")
    r = client.chat.completions.create(model="mirror", messages=msgs, max_tokens=40, temperature=0,
                                       response_format={"type": "structural_tag", **TAG})
    assert r.choices[0].message.content == refs["tag"].text and refs["tag"].text.startswith("<f>")
    r = client.chat.completions.create(model="mirror", messages=msgs, max_tokens=5, temperature=0,
                                       response_format={"type": "text"})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bench_serve_sends_each_prompts_guide(guided_server, mirror, tmp_path, endpoint):
    """`eyas bench serve` with guided prompt records: each request carries its guide (response_format on chat,
    vLLM's guided_* fields otherwise), the server decodes under it, and the summary counts as valid exactly the
    outputs that offline guided decoding of the same prompts makes valid; `--no-guided` sends them free."""
    from eyas.bench.tpc import matches_guide, read_prompts
    from eyas.cli import main
    recs = [{"prompt": "json", "json_schema": SCHEMA}, {"prompt": "yes?", "regex": r"(yes|no), [0-9]{1,3}!"},
            {"prompt": "pick", "choice": ["abc", "ba"]}, {"prompt": "{", "json_object": True},
            {"prompt": "a b", "grammar": 'root ::= ("ab" | "c")+ "."'}, {"prompt": "free"}]
    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in recs))
    common = ["bench", "serve", "--base-url", guided_server.url + "/v1", "--model", "mirror", "--endpoint", endpoint,
              "--prompts", str(file), "--num-prompts", str(len(recs)), "--max-tokens", "40", "--no-progress"]
    assert main(common + ["--out", str(tmp_path / "g")]) == 0
    res = json.loads((tmp_path / "g" / "serve.json").read_text())
    assert res["summary"]["failed"] == 0 and res["summary"]["guided"] == res["meta"]["guided"] == 5
    assert [r.get("guided") for r in res["requests"]] == ["json", "regex", "choice", "json_object", "grammar", None]
    target, draft, _ = mirror
    llm = LLM(str(target), device="cpu", dtype="float32")
    guides = [r["guided"] for r in read_prompts(file)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, seed=0, guided=g) for g in guides]
    if endpoint == "chat":
        outs = llm.chat([[{"role": "user", "content": r["prompt"]}] for r in recs], params)
    else:
        outs = llm.generate([r["prompt"] for r in recs], params)
    valid = [g is not None and o.finish_reason == "stop" and matches_guide(g, o.text) for g, o in zip(guides, outs)]
    assert [bool(r.get("guided_valid")) for r in res["requests"]] == valid and any(valid)
    assert res["summary"]["guided_valid"] == sum(valid)
    assert main(common + ["--out", str(tmp_path / "f"), "--no-guided"]) == 0
    free = json.loads((tmp_path / "f" / "serve.json").read_text())
    assert free["summary"]["guided"] == 0 and not any("guided" in r for r in free["requests"])


def test_server_rejects_bad_guides_with_400(guided_server):
    import httpx
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"response_format": {"type": "xml"}}, "response_format.type", "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema", "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
         "json_schema.schema", "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "at most one", "guided_regex"),
        ({"guided_choice": []}, "non-empty list", "guided_choice"),
        ({"guided_regex": "a("}, "invalid regex", None),
        ({"guided_json": {"type": "objec"}}, "invalid json", None),
        ({"guided_grammar": "root ::= ("}, "invalid grammar", None),
        ({"response_format": {"type": "structural_tag"}}, "guided structural_tag", "response_format"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "invalid structural_tag",
         None),
    ]
    with httpx.Client(base_url=guided_server.url, timeout=60) as http:
        for extra, words, param in cases:
            r = http.post("/v1/chat/completions", json={"model": "mirror", "messages": msgs, **extra})
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert words in err["message"] and err["param"] == param, (extra, err)
        r = http.post("/v1/completions", json={"model": "mirror", "prompt": "x", "guided_choice": "abc"})
        assert r.status_code == 422  # a string is not a list of choices: the schema's error
    assert guided_server.wait_idle()["eyas:kv_cache_used_blocks{}"] == 0


def test_server_answers_500_for_an_xgrammar_fault(guided_server, monkeypatch):
    import httpx
    compiler = guided_server.engine.grammar_backend().compiler
    monkeypatch.setattr(compiler, "compile_regex", _raise(XGRAMMAR_FAULT))
    with httpx.Client(base_url=guided_server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "mirror", "prompt": "x", "guided_regex": "(yes|no)"})
        assert r.status_code == 500, r.text
        assert "xgrammar failed to compile a regex" in r.json()["error"]["message"]
    assert guided_server.wait_idle()["eyas:kv_cache_used_blocks{}"] == 0


# ---- the embedded model and its shipped draft ----------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_json_schema_with_its_draft(smollm2):
    """SmolLM2 asked for JSON under a schema: the shipped draft's chain and tree give the plain guided tokens, the
    outputs parse and hold the schema's keys, and the draft still gets tokens accepted. (The tree's engine is built
    on the chain's loaded target and draft, as `LLM` builds one: the GGUF file is read once.)"""
    from eyas.engine.llm import build_engine
    from eyas.spec.tree import resolve_tree
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "colour": {"type": "string"}}, "required": ["name", "age", "colour"]}
    conv = [[{"role": "user", "content": "Describe a cat as JSON with its name, age and colour."}],
            [{"role": "user", "content": "Extract the person from this sentence as JSON (name, age, colour of "
                                         "hair): 'Anna, 34, has red hair.'"}]]
    params = SamplingParams(max_tokens=64, guided=GuidedDecoding(json=schema))
    plain = smollm2.chat(conv, params)
    for o in plain:
        assert o.finish_reason == "stop" and set(json.loads(o.text)) == {"name", "age", "colour"}, o.text
    llm = LLM("smollm2", device="cpu", dtype="float32", draft="default", speculation="chain:3")
    for spec in ("chain:3", "tree:8"):
        if spec == "tree:8":
            llm.engine = build_engine(llm.target, llm.tokenizer, llm.draft, resolve_tree(spec), spec)
        out = llm.chat(conv, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain], spec
        assert sum(o.stats.committed for o in out) > 1.5 * sum(o.stats.target_calls for o in out), spec


# ---- the command line and the benchmark ----------------------------------------------------------------------------

def test_generate_command_line_guides(mirror, tmp_path, capsys):
    from eyas.cli import main
    target, draft, _ = mirror
    base = ["generate", "--model", str(target), "--draft", str(draft), "--speculation", "chain:3", "--device", "cpu",
            "--dtype", "float32", "--prompt", "yes?", "--max-tokens", "30"]
    assert main(base + ["--regex", r"(yes|no), [0-9]{1,3}!"]) == 0
    assert re.fullmatch(r"(yes|no), [0-9]{1,3}!", capsys.readouterr().out.strip())
    assert main(base + ["--choice", "abc", "ba"]) == 0
    assert capsys.readouterr().out.strip() in ("abc", "ba")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(base + ["--json-schema", str(schema), "--max-tokens", "60"]) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith('{"a": ')
    # bad guides exit 2 with a message, before anything is generated
    assert main(base + ["--json-schema", "{not json"]) == 2
    assert "--json-schema" in capsys.readouterr().err
    assert main(base + ["--regex", "a("]) == 2
    assert "invalid regex" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: at most one guide
        main(base + ["--regex", "a", "--json-object"])


def test_bench_tpc_guided_prompts(mirror, tmp_path):
    from eyas.bench.tpc import main, read_prompts
    target, draft, _ = mirror
    f = tmp_path / "tasks.jsonl"
    recs = [{"id": 1, "prompt": "json", "json_schema": SCHEMA}, {"id": 2, "prompt": "yes?", "regex": r"(yes|no)!"},
            {"id": 3, "prompt": "pick", "choice": ["abc", "ba"]}, {"id": 4, "prompt": "free text"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert [r["guided"].kind if r["guided"] else None for r in read_prompts(f)] == ["json", "regex", "choice", None]
    out = tmp_path / "out"
    common = ["--model", str(target), "--draft", str(draft), "--prompts", str(f), "--max-tokens", "40",
              "--device", "cpu", "--dtype", "float32", "--speculation", "tree:8"]
    assert main(common + ["--out", str(out)]) == 0
    r = json.loads((out / "tpc.json").read_text())["results"][0]
    assert r["guided"] == 3 and r["guided_ended"] >= 2 and r["guided_valid"] == r["guided_ended"]
    assert "guided (valid / ended)" in (out / "tpc.md").read_text()
    assert main(common + ["--out", str(tmp_path / "free"), "--no-guided"]) == 0
    assert "guided" not in json.loads((tmp_path / "free" / "tpc.json").read_text())["results"][0]
    f.write_text(json.dumps({"id": 9, "prompt": "x", "regex": "a", "choice": ["a"]}) + "\n")
    with pytest.raises(ValueError, match="record 9: guided decoding takes exactly one"):
        read_prompts(f)
