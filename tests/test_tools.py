"""Tool calling (eyas.serve.tools): OpenAI's `tools` and `tool_choice` on /v1/chat/completions.

Oracles: offline guided decoding (`LLM.chat` with the guide a tool choice implies) for what named and "required"
calls must say, `json` for the parsers, the non-streaming reply for the stream's (hypothesis: any split of the text
into deltas), and the chat template rendered by hand for what reaches the model. A real client (openai) reads the
replies."""
from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas import LLM, GuidedDecoding, SamplingParams
from eyas.serve.tools import (HermesParser, Llama3JsonParser, MistralParser, ToolStream, required_schema,
                              tool_guide)
from helpers import write_guided_mirror

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99},
                                                                   "b": {"type": "string", "enum": ["x", "yz"]}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: any object
TOOLS = [WEATHER, ADD, PING]
NAMES = {t["function"]["name"] for t in TOOLS}
# a template that shows the tools (their names: the tiny model's context is short) and the calls of earlier turns,
# as HF's tool-aware templates do
TOOL_TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
                 "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                 "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
                 "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
                 "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}{{ '\\n' }}{% endfor %}assistant: ")
MSGS = [{"role": "user", "content": "weather?"}]
# what a hermes model writes: content, then two calls (forced here by a regex, which "auto" lets through)
HERMES_REGEX = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n'
                r'</tool_call>\n<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": "x"\}\}\n</tool_call>')


def strip_ids(msg: dict) -> dict:
    calls = [{k: v for k, v in c.items() if k != "id"} for c in msg.get("tool_calls", [])]
    return {**msg, "tool_calls": calls} if calls else msg


# ---- parsers -------------------------------------------------------------------------------------------------------

def reference_calls(choice: str, text: str):
    """The calls in a finished text, read whole by `json` (the oracle): (content, [(name, arguments)]), or None
    where some call is not well formed (cut short, or not a call object)."""
    import re
    if choice == "mistral":
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        try:
            arr = json.loads(text[at + len("[TOOL_CALLS]"):])
        except ValueError:
            return None
        if not isinstance(arr, list) or not arr or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                          for o in arr):
            return None
        return (text[:at] if text[:at].strip() else None), [(o["name"], o.get("arguments", {})) for o in arr]
    if choice == "hermes":
        at = text.find("<tool_call>")
        if at < 0:
            return text, []
        segs = [m.group(1) if m.group(1) is not None else m.group(2) for m in re.finditer(
            r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", text[at:], re.DOTALL)]
        content = text[:at] if text[:at].strip() else None
    else:
        s = text.strip().removeprefix("<|python_tag|>").lstrip()
        if not s.startswith("{"):
            return text, []
        segs = [x for x in re.split(r"\s*;\s*", s)]
        content = None
    calls = []
    for seg in segs:
        try:
            obj = json.loads(seg)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append((obj["name"], json.loads(args) if isinstance(args, str) else args))
    return content, calls


def whole(choice: str, text: str, reason: str = "stop"):
    parser = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(), "mistral": MistralParser()}[choice]
    msg, reason = ToolStream("auto", parser).message(text, reason)
    return msg["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])], \
        reason


def test_hermes_calls():
    """Content, then calls; the arguments as the model wrote them (spacing kept), or a string's value; a call cut
    short keeps what was written (finish_reason "length"); text in which no call's name could be read is content."""
    text = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": "é"}}')  # the last one unterminated
    assert whole("hermes", text) == ("I will look.\n", [("get_weather", '{"city":"Rome"}'),
                                                        ("add", '{"a": 1, "b": "é"}')], "tool_calls")
    assert whole("hermes", '<tool_call>{"name": "ping"}</tool_call>') == (None, [("ping", "{}")], "tool_calls")
    assert whole("hermes", '<tool_call>{"n\\"b": "\\"}", "name": "p\\"q"}') == (None, [('p"q', "{}")], "tool_calls")
    assert whole("hermes", '<tool_call>{"arguments": "{\\"a\\": 2}", "name": "add"}') == (
        None, [("add", '{"a": 2}')], "tool_calls")  # arguments first, as a string
    assert whole("hermes", '<tool_call>{"name": "add", "arguments": {"a": [1, "}"', "length") == (
        None, [("add", '{"a": [1, "}"')], "length")
    assert whole("hermes", '<tool_call>{"name": "add", "arguments": 5 , "x": 1}') == (None, [("add", "5")],
                                                                                      "tool_calls")
    for bad in ("plain words", '<tool_call>{"nam', '<tool_call>["add"]</tool_call>', "x <tool_call> y",
                '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": 5}</tool_call>'):
        assert whole("hermes", bad) == (bad, [], "stop"), bad
    # a malformed call between good ones is passed over (its closing tag ends it)
    assert whole("hermes", '<tool_call>{"x</tool_call><tool_call>{"name": "ping"}</tool_call>')[1] == [("ping", "{}")]
    p = HermesParser()
    assert p.content_end("abc <tool") == 4 and p.content_end("abc <tool_call>{") == 4
    assert p.content_end("abc <") == 4 and p.content_end("a <b") == 4 and p.content_end("abc") == 3


def test_mistral_calls():
    text = ('Let me see.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": "x"}}, '
            '{"name": "ping", "arguments": {}}]')
    assert whole("mistral", text) == ("Let me see.", [("add", '{"a": 1, "b": "x"}'), ("ping", "{}")], "tool_calls")
    assert whole("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1', "length") == (
        None, [("add", '{"a": 1')], "length")
    for bad in ("no calls", "[TOOL_CALLS]nope", "[TOOL_CALLS][]", '[TOOL_CALLS][{"arguments": {}}]'):
        assert whole("mistral", bad) == (bad, [], "stop"), bad
    assert MistralParser().content_end("abc [TOOL") == 4 and MistralParser().content_end("abc") == 3


def test_llama3_json_calls():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": "x"}}; {"name": "ping", "arguments": {}}'
    assert whole("llama3_json", text) == (None, [("add", '{"a": 1, "b": "x"}'), ("ping", "{}")], "tool_calls")
    assert whole("llama3_json", ' {"name": "ping", "parameters": {}}\n')[1] == [("ping", "{}")]
    assert whole("llama3_json", '{"name": "add", "parameters": {"a": 1', "length") == (
        None, [("add", '{"a": 1')], "length")
    assert whole("llama3_json", '{"name": "add", "parameters": {}} and then')[1] == [("add", "{}")]
    for bad in ("The answer is 4.", "[1, 2]", '{"parameters": {}}', '<|python_tag|>nothing', '{"a": 1}'):
        assert whole("llama3_json", bad) == (bad, [], "stop"), bad
    p = Llama3JsonParser()
    assert p.content_end("  ") == 0 and p.content_end(' {"na') == 0 and p.content_end("<|pyt") == 0
    assert p.content_end("Hello") == 5


# ---- the reply, streamed and whole -----------------------------------------------------------------------------------

def merge(deltas: list[dict]) -> dict:
    """What a client makes of a choice's stream deltas (as the openai SDK's helpers accumulate them)."""
    msg, calls = {"role": "assistant", "content": None}, {}
    for d in deltas:
        if "content" in d:
            msg["content"] = (msg["content"] or "") + d["content"]
        for c in d.get("tool_calls", []):
            if c["index"] not in calls:
                calls[c["index"]] = {"id": c["id"], "type": c["type"], "function": dict(c["function"])}
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    else:  # a stream's first chunk has content "" (beside the role)
        msg["content"] = msg["content"] or ""
    return msg


HERMES_CALLS = ['<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', '<tool_call>{"name": "ping"}',
                '<tool_call>{"name": "x", "argu', "<tool_call>[1]</tool_call>",
                '<tool_call>{"arguments": "{\\"a\\": 2}", "name": "add"}</tool_call>',
                '<tool_call>{"name": "add", "arguments": {"s": "}{\\"<", "t": [1, {}]}}</tool_call>\n',
                '<tool_call> {"name": "ad\\u0064", "arguments": 5 }</tool_call>']
MISTRAL_CALLS = ['{"name": "add", "arguments": {"a": 1, "b": "x"}}', '{"name": "ping", "arguments": {}}',
                 '{"name": "add", "arguments": {"a": [1, "]"]}}', '{"name": "add", "argu']
LLAMA_CALLS = ['{"name": "add", "parameters": {"a": 1}}', '<|python_tag|>{"name": "ping", "arguments": {}}',
               '{"name": "add", "parameters": {"a"', '{"name": "add", "arguments": {"a": [1, {"b": ";"}]}}']


@st.composite
def replies(draw):
    """(choice, text): what a model might write under each choice: content, then calls (some malformed or cut)."""
    choice = draw(st.sampled_from(["hermes", "llama3_json", "mistral", "required", "add"]))
    content = draw(st.sampled_from(["", " ", "\n", "Sure.\n", "I'll check <tool", "a <b> c", "x{"]))
    if choice == "hermes":
        return choice, content + "".join(draw(st.lists(st.sampled_from(HERMES_CALLS), max_size=3)))
    if choice == "mistral":
        calls = draw(st.lists(st.sampled_from(MISTRAL_CALLS), max_size=3))
        return choice, content + ("[TOOL_CALLS][" + ", ".join(calls) + draw(st.sampled_from(["]", ""]))
                                  if calls else "")
    if choice == "llama3_json":
        calls = draw(st.lists(st.sampled_from(LLAMA_CALLS), max_size=3))
        return choice, draw(st.sampled_from(["", " ", content])) + "; ".join(calls)
    if choice == "required":
        return choice, draw(st.sampled_from([
            '[{"name": "add", "parameters": {"a": 1}}]', '[{"name": "add", "par',
            '[{"name": "add", "parameters": {"a": "}]\\""}}, {"name": "ping", "p',
            '[{"name": "ping", "parameters": {}}, {"name": "add", "parameters": {}}]']))
    return choice, draw(st.sampled_from(['{"a": 1, "b": "x"}', '{"a": 1', ""]))


@settings(max_examples=400, deadline=None)
@given(reply=replies(), cuts=st.lists(st.integers(0, 120), max_size=10), reason=st.sampled_from(["stop", "length"]))
def test_stream_deltas_make_the_whole_reply(reply, cuts, reason):
    """Any split of a text into deltas streams the reply the non-streaming path gives: the same content and calls
    (ids aside) and finish_reason; content once sent is never taken back (it is what the parser calls content)."""
    choice, text = reply
    parsers = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(), "mistral": MistralParser()}
    mode = "auto" if choice in parsers else choice
    whole, whole_reason = ToolStream(mode, parsers.get(choice)).message(text, reason)
    ts, deltas = ToolStream(mode, parsers.get(choice)), []
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(bounds, bounds[1:]):
        deltas += ts.feed(text[a:b])
    streamed = "".join(d.get("content", "") for d in deltas)
    last, reason_out = ts.finish(reason)
    assert strip_ids(merge(deltas + last)) == strip_ids(whole) and reason_out == whole_reason
    assert (whole["content"] or "").startswith(streamed)
    if mode == "auto":  # well formed: the calls json reads; cut short: each call's arguments as far as written
        ref = reference_calls(choice, text)
        calls = whole.get("tool_calls", [])
        if ref is not None:
            assert whole["content"] == ref[0]
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == ref[1]
        for c in calls:  # what the model wrote (or a string's value, or the default)
            args = c["function"]["arguments"]
            assert args in text or json.dumps(args) in text or args == "{}"
        assert whole_reason == (("tool_calls" if reason == "stop" else reason) if calls else reason)
        if not calls:
            assert whole["content"] == text


def test_named_and_required_replies():
    msg, reason = ToolStream("add").message('{"a": 1, "b": "x"}', "stop")
    assert reason == "stop" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": "x"}'}
    msg, reason = ToolStream("add").message('{"a": 1', "length")  # cut short: the call as written, as OpenAI's
    assert reason == "length" and msg["tool_calls"][0]["function"]["arguments"] == '{"a": 1'
    text = '[{"name": "add", "parameters": {"a": 2, "b": "yz"}}, {"name": "ping", "parameters": {}}]'
    msg, reason = ToolStream("required").message(text, "stop")
    assert reason == "tool_calls" and msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("add", '{"a": 2, "b": "yz"}'), ("ping", "{}")]
    msg, reason = ToolStream("required").message('[{"name": "add", "param', "length")
    assert (msg, reason) == ({"role": "assistant", "content": '[{"name": "add", "param'}, "length")
    cut = '[{"name": "add", "parameters": {"a": "]}\\"{"}}, {"name": "ping", "param'  # an item closed, then cut
    msg, reason = ToolStream("required").message(cut, "length")
    assert reason == "length" and msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("add", {"a": ']}"{'})]
    for bad in ("[]", '[{"name": "add"}]'):  # no call in them: content
        assert ToolStream("required").message(bad, "stop") == ({"role": "assistant", "content": bad}, "stop")


def test_tool_guides_compile_and_hold_the_calls(tmp_path):
    """The guides of "required" and of a named choice compile (xgrammar); `parallel_tool_calls: false` allows one
    call; "auto" and "none" put none on the output."""
    from eyas.spec.grammar import GrammarBackend
    from helpers import tiny_tokenizer
    tok = tiny_tokenizer()
    be = GrammarBackend(tok, tok.vocab_size, [tok.eos_token_id])
    schema = required_schema(TOOLS)
    assert schema["minItems"] == 1 and "maxItems" not in schema and required_schema(TOOLS, False)["maxItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["get_weather"], ["add"], ["ping"]]
    assert schema["items"]["anyOf"][2]["properties"]["parameters"] == {"type": "object", "properties": {}}
    for choice in ("required", "add", "ping"):
        g = tool_guide(TOOLS, choice)
        be.compile(g)
    assert tool_guide(TOOLS, "add").json == ADD["function"]["parameters"]
    assert tool_guide(TOOLS, "auto") is None and tool_guide(TOOLS, "none") is None


def test_chat_template_reads_tools_and_earlier_calls(tmp_path):
    """`tools` reach the template, and an assistant's earlier call reaches it with its arguments as an object
    (`arguments | tojson` writes them once, not as a quoted string), as HF's templates expect."""
    target, _, tok = write_guided_mirror(tmp_path)
    tok.chat_template = TOOL_TEMPLATE
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    from eyas.serve.protocol import ChatMessage
    rendered = tok.apply_chat_template([ChatMessage(**m).template_dict() for m in history], tools=[WEATHER])
    assert rendered == ("tools: get_weather\nuser: weather?\n"
                        'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
                        "tool: sunny [call_1]\nassistant: ")


# ---- the server ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """The guided mirror pair (tree speculation) behind a server that reads "auto" calls as hermes writes them,
    with a template that shows the tools; `.llm` computes offline references before the server takes over."""
    from eyas.serve.api_server import create_app
    from test_server import LiveServer
    target, draft, _ = write_guided_mirror(tmp_path_factory.mktemp("tools"))
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOL_TEMPLATE}))
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="tree:8")
    greedy = SamplingParams(max_tokens=150, temperature=0.0)

    def offline(max_tokens=150, logit_bias=None, **guide):
        import dataclasses
        params = dataclasses.replace(greedy, guided=GuidedDecoding(**guide), max_tokens=max_tokens,
                                     logit_bias=logit_bias)
        return llm.chat(MSGS, params, tools=TOOLS)[0]

    close = llm.tokenizer.encode("]")
    assert len(close) == 1

    refs = {"add": offline(json=ADD["function"]["parameters"]),
            "required": offline(json=required_schema(TOOLS, parallel=False)),
            # "]" ruled out, so the array goes on until max_tokens cuts it
            "required_many": offline(json=required_schema(TOOLS), logit_bias={close[0]: -100.0}),
            "hermes": offline(regex=HERMES_REGEX, max_tokens=250),
            "none": llm.chat(MSGS, SamplingParams(max_tokens=12, temperature=0.0), tools=TOOLS)[0]}
    server = LiveServer(create_app(llm, "mirror", tool_parser="hermes"))
    server.refs, server.close_id = refs, close[0]
    yield server
    server.close()


def test_named_tool_choice_is_offline_guided_decoding(tool_server):
    """A named function: one call of it whose arguments are what offline decoding under its parameters' schema
    writes (greedy, speculative tree), whole and streamed; finish_reason "stop" as OpenAI gives."""
    ref = tool_server.refs["add"]
    assert ref.finish_reason == "stop" and set(json.loads(ref.text)) == {"a", "b"}
    client = tool_server.client()
    kw = dict(model="mirror", messages=MSGS, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
              max_tokens=150, temperature=0)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None and len(c.message.tool_calls) == 1
    assert (c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments) == ("add", ref.text)
    assert r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "add" and all(tc.id is None for tc in calls[1:])
    assert len(calls) > 1  # streamed as written, not whole at the end
    assert "".join(tc.function.arguments for tc in calls) == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.chat.completions.create(**{**kw, "n": 2})  # every choice its own call
    assert [ch.message.tool_calls[0].function.arguments for ch in r.choices] == [ref.text] * 2
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id


def test_required_tool_choice_is_offline_guided_decoding(tool_server):
    """"required" with `parallel_tool_calls: false`: the call offline decoding under vLLM's array schema writes, as
    a tool call (finish_reason "tool_calls"), whole and streamed; cut short by max_tokens it is content."""
    ref = tool_server.refs["required"]
    assert ref.finish_reason == "stop"
    (want,) = json.loads(ref.text)
    assert want["name"] in NAMES
    client = tool_server.client()
    kw = dict(model="mirror", messages=MSGS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=150, temperature=0)
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
            finish = chunks[-1].choices[0].finish_reason
            assert not any(ch.choices[0].delta.content for ch in chunks)
        else:
            c = client.chat.completions.create(**kw).choices[0]
            calls, finish = c.message.tool_calls, c.finish_reason
            assert c.message.content is None
        assert finish == "tool_calls" and len(calls) == 1
        assert (calls[0].function.name, json.loads(calls[0].function.arguments)) == (want["name"], want["parameters"])
    c = client.chat.completions.create(**{**kw, "max_tokens": 5}).choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None and c.message.content == ref.text[:len(
        c.message.content)] and c.message.content
    # parallel calls, "]" ruled out by a logit bias: the array goes on until max_tokens cuts it; the items closed
    # by then are the calls, each streamed as its item closes
    many = tool_server.refs["required_many"]
    assert many.finish_reason == "length"
    want = [(x["function"]["name"], json.loads(x["function"]["arguments"]))
            for x in ToolStream("required").message(many.text, "length")[0]["tool_calls"]]
    assert len(want) >= 2 and many.text.startswith(json.dumps([{"name": n, "parameters": a} for n, a in want])[:-1])
    kw = {**kw, "parallel_tool_calls": True, "logit_bias": {str(tool_server.close_id): -100}}
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == want
    chunks = list(client.chat.completions.create(**kw, stream=True))
    with_calls = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices[0].delta.tool_calls]
    assert [len(x) for x in with_calls] == [1] * len(want) and [x[0].index for x in with_calls] == list(range(len(want)))
    assert [(x[0].function.name, json.loads(x[0].function.arguments)) for x in with_calls] == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_auto_tool_calls_are_read_back_by_the_parser(tool_server):
    """"auto" (the default with tools): text a hermes model writes (forced by a regex here) comes back as content
    and two tool calls, whole and streamed alike (the arguments streamed as they are written); text without calls
    is content; "none" is plain chat."""
    ref = tool_server.refs["hermes"]
    assert ref.finish_reason == "stop"
    client = tool_server.client()
    kw = dict(model="mirror", messages=MSGS, tools=TOOLS, max_tokens=250, temperature=0,
              extra_body={"guided_regex": HERMES_REGEX})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure.\n"
    got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    assert got == reference_calls("hermes", ref.text)[1]
    assert [n for n, _ in got] == ["get_weather", "add"]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [ch.choices[0].delta.model_dump(exclude_none=True) for ch in chunks]
    # the calls' arguments arrive in pieces as they are written (the first piece with the call's name)
    pieces = [t for d in deltas for t in d.get("tool_calls", [])]
    assert len(pieces) > 2 and sum(1 for t in pieces if t.get("id")) == 2
    assert strip_ids(merge([d for d in deltas if d.get("content") or d.get("tool_calls")])) == strip_ids(
        c.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    none = client.chat.completions.create(model="mirror", messages=MSGS, tools=TOOLS, tool_choice="none",
                                          max_tokens=12, temperature=0).choices[0]
    assert (none.message.content, none.message.tool_calls) == (tool_server.refs["none"].text, None)
    free = client.chat.completions.create(model="mirror", messages=MSGS, tools=TOOLS, max_tokens=12,
                                          temperature=0).choices[0]
    assert (free.message.content, free.finish_reason) == (tool_server.refs["none"].text, "length")


def test_tools_and_earlier_calls_reach_the_template(tool_server):
    """/tokenize with tools and a conversation holding a call and its result: the prompt the template makes
    (tools listed, arguments as an object); chat requests read the same prompt (usage)."""
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    tok = tool_server.engine.tokenizer
    want = ("tools: get_weather add ping\nuser: weather?\n"
            'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
            "tool: sunny [call_1]\nassistant: ")
    r = httpx.post(tool_server.url + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(want)
    out = tool_server.client().chat.completions.create(model="mirror", messages=history, tools=TOOLS,
                                                       tool_choice="none", max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == len(tok.encode(want))


def test_bad_tool_requests_get_400(tool_server):
    named = {"type": "function", "function": {"name": "add"}}
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among",
         "tool_choice", 400),
        ({"tool_choice": "required"}, "needs tools", "tool_choice", 400),
        ({"tool_choice": named}, "needs tools", "tool_choice", 400),
        ({"tools": TOOLS + [ADD]}, "given twice", "tools", 400),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "must match", "tools", 400),
        ({"tools": TOOLS, "tool_choice": named, "response_format": {"type": "json_object"}}, "does not combine",
         "tool_choice", 400),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "does not combine", "tool_choice", 400),
        ({"tools": TOOLS, "tool_choice": named, "min_tokens": 2}, "min_tokens", "tool_choice", 400),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
          "tool_choice": "required"}, "invalid json", None, 400),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools", 422),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice", 422),
    ]
    with httpx.Client(base_url=tool_server.url, timeout=60) as http:
        for extra, words, param, status in cases:
            r = http.post("/v1/chat/completions", json={"model": "mirror", "messages": MSGS, **extra})
            assert r.status_code == status, (extra, r.text)
            err = r.json()["error"]
            assert words in err["message"] and err["param"] == param, (extra, err)
    assert tool_server.wait_idle()["eyas:kv_cache_used_blocks{}"] == 0


def test_auto_without_a_parser_is_a_400(tmp_path):
    """A server started without --enable-auto-tool-choice refuses "auto" (and tools without a tool_choice, whose
    default it is), as vLLM does, and serves "none"; the command line asks for the parser with the flag."""
    import argparse

    from fastapi.testclient import TestClient

    from eyas.serve.api_server import add_serve_parser, create_app, run_serve
    target, _, _ = write_guided_mirror(tmp_path)
    with TestClient(create_app(LLM(str(target), device="cpu", dtype="float32"), "mirror")) as http:
        for extra in ({}, {"tool_choice": "auto"}):
            r = http.post("/v1/chat/completions", json={"model": "mirror", "messages": MSGS, "tools": TOOLS, **extra})
            assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"], r.text
        r = http.post("/v1/chat/completions", json={"model": "mirror", "messages": MSGS, "tools": TOOLS,
                                                    "tool_choice": "none", "max_tokens": 2, "temperature": 0})
        message = r.json()["choices"][0]["message"]  # plain text (unseeded sampling at T=1 drew the end token once:
        assert r.status_code == 200 and isinstance(message["content"], str) and "tool_calls" not in message  # "")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="--tool-call-parser"):
        run_serve(args)
    args = parser.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")


def test_ruled_out_tokens_get_vllms_floor_not_infinity(tool_server):
    """Log-probabilities with a guided call: tokens the grammar rules out (logit -inf) among the top 5 are reported
    at -9999.0 (vLLM's floor), so the body is strict JSON, whole and streamed (JSON has no infinity: Starlette
    refused to write it, a 500)."""
    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))

    body = {"model": "mirror", "messages": MSGS, "tools": TOOLS, "max_tokens": 150, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "logprobs": True,
            "top_logprobs": 5}
    r = httpx.post(tool_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    content = strict(r.text)["choices"][0]["logprobs"]["content"]
    first = [t["logprob"] for t in content[0]["top_logprobs"]]
    # the grammar allows the first token two ways ("{" and '{"'), which hold all of its probability
    assert [t["token"] for t in content[0]["top_logprobs"][:2]] == ["{", '{"'] and first[2:] == [-9999.0] * 3
    assert math.exp(first[0]) + math.exp(first[1]) == pytest.approx(1.0, abs=1e-4)
    assert all(x["logprob"] <= 0 for c in content for x in [c] + c["top_logprobs"])
    with httpx.stream("POST", tool_server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as s:
        events = [strict(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    streamed = [c for e in events for c in ((e["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert streamed == content


# ---- chat templates of the request's or the server's own ---------------------------------------------------------

def test_chat_template_override_and_kwargs(tool_server, tmp_path):
    """vLLM's `chat_template` (a request's own, or `eyas serve --chat-template FILE|TEMPLATE`) and
    `chat_template_kwargs` (more variables): /tokenize and chat read the prompt they render; a broken template
    or a variable the call sets itself is a 400 naming the field."""
    import argparse

    from eyas.serve.api_server import _chat_template, add_serve_parser
    tok = tool_server.engine.tokenizer
    own = "{% for m in messages %}<{{ m['role'] }}|{{ style }}>{{ m['content'] }}{% endfor %}>"
    want = "<user|terse>weather?>"
    assert tok.apply_chat_template(MSGS, chat_template=own, style="terse") == want
    with pytest.raises(ValueError, match="set by the call itself"):
        tok.apply_chat_template(MSGS, chat_template=own, bos_token="x")
    body = {"messages": MSGS, "chat_template": own, "chat_template_kwargs": {"style": "terse"}}
    r = httpx.post(tool_server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(want), r.text
    out = tool_server.client().chat.completions.create(
        model="mirror", messages=MSGS, max_tokens=2, temperature=0,
        extra_body={"chat_template": own, "chat_template_kwargs": {"style": "terse"}})
    assert out.usage.prompt_tokens == len(tok.encode(want))
    for extra, param in (({"chat_template": "{% for m in messages %}"}, "chat_template"),
                         ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": "x"}, "chat_template_kwargs")):
        r = httpx.post(tool_server.url + "/v1/chat/completions", json={"model": "mirror", "messages": MSGS, **extra},
                       timeout=60)
        assert r.status_code in (400, 422) and r.json()["error"]["param"] == param, (extra, r.text)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    file = tmp_path / "t.jinja"
    file.write_text(own)
    assert _chat_template(parser.parse_args(["serve", "--chat-template", str(file)])) == own
    assert _chat_template(parser.parse_args(["serve", "--chat-template", own])) == own
    assert _chat_template(parser.parse_args(["serve"])) is None
    for bad, words in ((str(tmp_path / "missing.jinja"), "no such file"), ("{% if %}", "not a valid Jinja")):
        with pytest.raises(ValueError, match=words):
            _chat_template(parser.parse_args(["serve", "--chat-template", bad]))


def test_chat_prompt_logprobs(tool_server):
    """vLLM's `prompt_logprobs` on chat: the reply's top-level field holds, per token of the templated prompt, the
    token's and the k likeliest log-probabilities and ranks, a dense forward's."""
    import torch
    tok, target = tool_server.engine.tokenizer, tool_server.engine.target
    ids = tok.encode(tok.apply_chat_template(MSGS))
    r = httpx.post(tool_server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "mirror", "messages": MSGS, "max_tokens": 2, "prompt_logprobs": 2, "n": 2})
    assert r.status_code == 200, r.text
    pl = r.json()["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids) and "prompt_logprobs" not in r.json()["choices"][0]
    with torch.no_grad():
        ref = torch.log_softmax(target.compute_logits(target(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]
                                .float(), -1)
    for j in range(1, len(ids)):
        row, t = ref[j - 1], ids[j]
        got = pl[j][str(t)]
        assert got["logprob"] == pytest.approx(row[t].item(), abs=1e-4) and got["rank"] == int((row > row[t]).sum()) + 1
        assert got["decoded_token"] == tok.decode([t], skip_special_tokens=False)
        assert {int(k) for k, v in pl[j].items() if v["rank"] <= 2} >= set(row.topk(2).indices.tolist())


def test_continuous_usage_on_text_chunks(tool_server):
    """vLLM's `continuous_usage_stats` on a chat stream of text: each text chunk carries the usage so far (the text
    chunks' fast path, `_TextChunk`, is bypassed for it), growing to the last chunk's whole."""
    with httpx.stream("POST", tool_server.url + "/v1/chat/completions", timeout=60, json={
            "model": "mirror", "messages": MSGS, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    text = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    done = [e["usage"]["completion_tokens"] for e in events]
    assert len(text) > 2 and all(e["usage"] is not None for e in events)
    assert done == sorted(done) and done[-1] == 12 and len(set(done)) > 2
