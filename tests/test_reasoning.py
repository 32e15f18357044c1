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
from test_guided import A_SCHEMA, GUIDES, exact_guided_law, fresh_mask, sampled_law_p


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


@pytest.fixture
def cuts(monkeypatch) -> list[bool]:
    """Each commit of a step that ran unmasked for a closed gated grammar: whether it was cut at the gate."""
    seen = []
    original = GatedGrammarState.cut_at_gate

    def spy(self, tokens):
        keep = original(self, tokens)
        seen.append(keep < len(tokens))
        return keep
    monkeypatch.setattr(GatedGrammarState, "cut_at_gate", spy)
    return seen


TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: <think>"


@pytest.mark.parametrize("spec", ["chain:3", "tree:8", "dyn:k4d3n8"])
def test_gated_guided_speculation_equals_plain(think_mirror, spec, cuts):
    """Greedy, with the gate set to a token the free output writes a few tokens in: the gated guided output equals
    the free output up to and including the gate, its rest matches the guide, and speculation (with a small pool,
    so that requests are preempted and their grammar rebuilt from their output) changes no token. Steps before the
    gate ran unmasked, and commits that held the gate before their last token were cut after it."""
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
    assert any(cuts) and fast.engine.runner.guided_steps < fast.engine.step_counts["decode"]


# ---- the parsers (eyas.serve.reasoning) ------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eyas.serve.reasoning import ReasoningStream, make_reasoning_parser  # noqa: E402
from eyas.serve.tools import ToolStream, make_parser, merge_deltas  # noqa: E402


def reference_split(text: str, thinking: bool) -> dict:
    """The reply a reasoning parser makes of a whole output, by string splitting: a leading `<think>` (blanks
    before it) opens the thinking, which runs to the first `</think>` (or the end); the rest is the answer."""
    lead = text.lstrip()
    if lead.startswith("<think>"):
        text, thinking = lead[len("<think>"):], True
    reasoning, content = (text.partition("</think>")[0], text.partition("</think>")[2]) if thinking else ("", text)
    msg = {"role": "assistant", "content": content or (None if reasoning else "")}
    if reasoning:
        msg["reasoning"] = msg["reasoning_content"] = reasoning
    return msg


PIECES = ["<think>", "</think>", "<", "</", "</th", "think>", "<thi", " ", "\n", "a", "b c", "ok."]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.booleans(),
       st.lists(st.integers(min_value=0, max_value=60), max_size=6))
def test_stream_pieces_make_the_whole_reply(pieces, thinking, cuts):
    """However the text is cut, the stream's pieces make the whole reply, and both are the string splitting's."""
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    s = ReasoningStream(thinking)
    deltas = [d for a, b in zip(bounds, bounds[1:]) for d in s.feed(text[a:b])]
    last, reason = s.finish("stop")
    want = reference_split(text, thinking)
    assert merge_deltas(deltas + last) == want and reason == "stop"
    assert ReasoningStream(thinking).message(text, "length") == (want, "length")


def test_tool_calls_are_read_from_the_answer_only():
    """A call written while thinking stays thinking; the answer's calls are tool calls (hermes), streamed or not;
    `include=False` drops the thinking."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    text = f"<think>maybe {call} then</think>Sure.{call}"
    make = lambda include=True: ReasoningStream(True, ToolStream("auto", make_parser("hermes")), include)  # noqa
    msg, reason = make().message(text, "stop")
    assert reason == "tool_calls" and msg["reasoning"] == f"maybe {call} then" and msg["content"] == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("add", {"a": 1})]
    s = make()
    deltas = [d for k in range(0, len(text), 5) for d in s.feed(text[k:k + 5])]
    last, _ = s.finish("stop")
    assert _no_ids(merge_deltas(deltas + last)) == _no_ids(msg)
    quiet, _ = make(include=False).message(text, "stop")
    assert "reasoning" not in quiet and quiet["content"] == "Sure."


def _no_ids(msg: dict) -> dict:
    return {**msg, "tool_calls": [{**c, "id": None} for c in msg.get("tool_calls", [])]}


def test_parser_needs_the_tags_and_reads_the_prompt():
    """A tokenizer without `<think>` tokens, no tokenizer, or an unknown name: ValueError. Where the output starts:
    the prompt's last tag, else the parser's default (Qwen3: `enable_thinking`)."""
    from helpers import tiny_tokenizer
    with pytest.raises(ValueError, match="no <think> or </think> token"):
        make_reasoning_parser("deepseek_r1", tiny_tokenizer())
    with pytest.raises(ValueError, match="no tokenizer"):
        make_reasoning_parser("qwen3", None)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        make_reasoning_parser("granite", think_tokenizer())
    tok = think_tokenizer()
    r1, q3 = make_reasoning_parser("deepseek_r1", tok), make_reasoning_parser("qwen3", tok)
    a, b = r1.start_id, r1.end_id
    assert (tok.decode([a], skip_special_tokens=True), tok.decode([b], skip_special_tokens=True)) == (
        "<think>", "</think>")
    for p in (r1, q3):
        assert p.thinking([5, a, 6]) and not p.thinking([a, 7, b, 6]) and p.thinking([a, 1, b, a])
    assert r1.thinking([5, 6], {"enable_thinking": False})  # R1 always thinks
    assert q3.thinking([5, 6]) and not q3.thinking([5, 6], {"enable_thinking": False})
    assert r1.reasoning_tokens([5, 6, b, 7], True) == 3 and r1.reasoning_tokens([5, 6], True) == 2
    assert r1.reasoning_tokens([5, 6, b, 7], False) == 0 and r1.reasoning_tokens([a, 6, b, 7], False) == 3


# ---- the server ----------------------------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "What is 2 + 3? Think first."}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def think_server(think_mirror):
    """The think mirror behind a server with `--reasoning-parser deepseek_r1`; a logit bias on `</think>` that makes
    the greedy output close its thinking after a few tokens (the smallest that does), and offline references."""
    from eyas.serve.api_server import create_app
    from test_server import LiveServer
    target, draft, tok = think_mirror
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="tree:8")
    end = tok.backend.token_to_id(UNTHINK)
    bias = None
    for b in range(8):
        ids = llm.chat(MSGS, SamplingParams(max_tokens=30, temperature=0.0, logit_bias={end: b}))[0].token_ids
        if end in ids and 2 <= ids.index(end) < 20:
            bias = b
            break
    assert bias is not None
    free = llm.chat(MSGS, SamplingParams(max_tokens=30, temperature=0.0, logit_bias={end: bias}))[0]
    guided = llm.chat(MSGS, SamplingParams(max_tokens=60, temperature=0.0, logit_bias={end: bias},
                                           guided=GuidedDecoding(json=SCHEMA, after_token_id=end)))[0]
    server = LiveServer(create_app(llm, "think", reasoning_parser="deepseek_r1"))
    server.end, server.bias, server.free, server.guided = end, bias, free, guided
    yield server
    server.close()


def _split_ids(tok, ids, end):
    k = ids.index(end)
    return tok.decode(ids[:k]), tok.decode(ids[k + 1:])


def test_chat_reply_holds_the_thinking_apart(think_server, think_mirror):
    """The thinking (up to `</think>`) as `reasoning` and `reasoning_content`, the rest as content: the offline
    output split at the tag, whole and streamed alike; `include_reasoning: false` drops it."""
    tok = think_mirror[2]
    client = think_server.client()
    free = think_server.free
    thought, answer = _split_ids(tok, free.token_ids, think_server.end)
    assert thought and answer
    kw = dict(model="think", messages=MSGS, max_tokens=30, temperature=0,
              logit_bias={str(think_server.end): think_server.bias})
    m = client.chat.completions.create(**kw).choices[0].message
    assert (m.reasoning, m.reasoning_content, m.content) == (thought, thought, answer)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    got = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    assert got == thought and "".join(d.content or "" for d in deltas) == answer
    assert sum(1 for d in deltas if getattr(d, "reasoning", None)) > 1  # streamed as written
    quiet = client.chat.completions.create(**kw, extra_body={"include_reasoning": False}).choices[0].message
    assert getattr(quiet, "reasoning", None) is None and quiet.content == answer


def test_a_guide_holds_the_answer_only(think_server, think_mirror):
    """response_format json_schema with a reasoning parser: the thinking is free and the answer follows the schema,
    token for token the offline output with the grammar gated at `</think>`; a prompt whose thinking is closed
    already (the template wrote `<think></think>`) is answered under the guide from its first token."""
    tok = think_mirror[2]
    client = think_server.client()
    ref = think_server.guided
    thought, answer = _split_ids(tok, ref.token_ids, think_server.end)
    assert ref.finish_reason == "stop" and isinstance(json.loads(answer)["a"], int) and thought
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    kw = dict(model="think", messages=MSGS, max_tokens=60, temperature=0, response_format=fmt,
              logit_bias={str(think_server.end): think_server.bias})
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert (m.reasoning, m.content, r.choices[0].finish_reason) == (thought, answer, "stop")
    assert r.usage.completion_tokens == len(ref.token_ids)
    closed = TEMPLATE + "</think>"
    r = client.chat.completions.create(**kw, extra_body={"chat_template": closed}).choices[0]
    assert getattr(r.message, "reasoning", None) is None and isinstance(json.loads(r.message.content)["a"], int)


def test_responses_reasoning_item(think_server, think_mirror):
    """/v1/responses: a reasoning item before the message, `reasoning_tokens` in the usage; streamed, its
    reasoning_text deltas make it, and the last event's response is the whole one (ids aside); a later response
    continues it (`previous_response_id`) and reasoning items are taken as input."""
    tok = think_mirror[2]
    client = think_server.client()
    free = think_server.free
    thought, answer = _split_ids(tok, free.token_ids, think_server.end)
    kw = dict(model="think", input=MSGS[0]["content"], max_output_tokens=30, temperature=0,
              extra_body={"logit_bias": {str(think_server.end): think_server.bias}})
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == thought and r.output_text == answer
    assert r.usage.output_tokens_details.reasoning_tokens == free.token_ids.index(think_server.end) + 1
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "response.reasoning_text.done" in kinds
    strip = lambda d: {**d, "id": None, "created_at": None, "output": [{**o, "id": None} for o in d["output"]]}  # noqa
    assert strip(events[-1].response.model_dump()) == strip(r.model_dump())
    again = client.responses.create(model="think", input="And 3 + 4?", previous_response_id=r.id,
                                    max_output_tokens=4, temperature=0)
    assert again.status in ("completed", "incomplete")
    items = [{"type": "message", "role": "user", "content": "hi"},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}], "summary": []},
             {"type": "message", "role": "assistant", "content": "hello"},
             {"type": "message", "role": "user", "content": "bye"}]
    assert client.responses.create(model="think", input=items, max_output_tokens=4, temperature=0).output


def test_server_refuses_a_parser_without_tags(tmp_path):
    """A reasoning parser on a model whose tokenizer has no `<think>` tokens stops the server before it serves."""
    from eyas.serve.api_server import create_app
    from helpers import write_guided_mirror
    target, _, _ = write_guided_mirror(tmp_path)
    llm = LLM(str(target), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="no <think> or </think> token"):
        create_app(llm, "m", reasoning_parser="qwen3")


@pytest.mark.slow
def test_gated_sampling_law_is_exact(think_mirror, cuts):
    """Sampled (T=1, top-3), the gate the prompt's likeliest next token, with the mirror draft (tree:8, so
    that the gate is often accepted in the middle of a path and the commit cut after it): the law of the whole
    output equals the enumerated law of plain gated sampling. (No logit bias: a request with any penalty or bias
    keeps masked steps, and would not be cut.)"""
    from transformers import LlamaForCausalLM
    target, draft, tok = think_mirror
    prompt = tok.encode("abab", add_bos=False)
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        gate = int(torch.topk(hf(torch.tensor([prompt])).logits[0, -1], 2).indices[0])
    guide = GuidedDecoding(choice=["ab", "ba", "b"], after_token_id=gate)
    law = exact_guided_law(target, tok, prompt, guide, top_k=3, max_tokens=5)
    assert len(law) >= 20 and abs(sum(law.values()) - 1) < 1e-9
    runs = 6000
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="tree:8",
              max_num_seqs=1024, num_blocks=1024 * 4 + 8, block_size=4)
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=5, seed=s, guided=guide) for s in range(runs)]
    p, _ = sampled_law_p(llm, prompt, params, law)
    print(f"{len(law)} outputs, chi-square p {p:.3f}, {sum(cuts)} commits cut at the gate")
    assert p > 1e-3, p
    assert sum(cuts) > runs // 20  # the cut is what is being tested
