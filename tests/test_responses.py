"""OpenAI's Responses API (eyas.serve.responses) through the openai client: a response says what the offline chat
with the same messages says (greedy, speculative), its stream's events make the same response, tools, text formats
and earlier calls map onto the chat's, `previous_response_id` continues a stored response, and bad input is a
400."""
from __future__ import annotations

import json

import httpx
import pytest

from eyas import LLM, GuidedDecoding, SamplingParams
from helpers import write_guided_mirror
from test_tools import ADD, HERMES_REGEX, TOOL_TEMPLATE, TOOLS

FLAT = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses' function tools
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from eyas.serve.api_server import create_app
    from test_server import LiveServer
    target, draft, _ = write_guided_mirror(tmp_path_factory.mktemp("responses"))
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOL_TEMPLATE}))
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="tree:8")
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    sys_user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"}]
    refs = {"plain": llm.chat([{"role": "user", "content": "weather?"}], greedy)[0],
            "instructed": llm.chat(sys_user, greedy)[0],
            "add": llm.chat([{"role": "user", "content": "add?"}], SamplingParams(
                max_tokens=150, guided=GuidedDecoding(json=ADD["function"]["parameters"])), tools=TOOLS)[0],
            "schema": llm.chat([{"role": "user", "content": "n?"}], SamplingParams(
                max_tokens=40, guided=GuidedDecoding(json=SCHEMA)))[0]}
    s = LiveServer(create_app(llm, "mirror", tool_parser="hermes"))
    s.refs, s.tokenizer = refs, llm.tokenizer
    yield s
    s.close()


def _strip(resp: dict) -> dict:
    """A response without what differs between two runs of it (ids, times)."""
    out = [{k: v for k, v in it.items() if k not in ("id", "call_id")} for it in resp["output"]]
    return {**{k: v for k, v in resp.items() if k not in ("id", "created_at")}, "output": out}


def _tokens(server, messages, tools=None) -> int:
    body = {"messages": messages} | ({"tools": tools} if tools else {})
    return httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["count"]


def test_a_response_says_what_the_chat_says(server):
    """Text in, text out: the offline chat's greedy text, its usage; `instructions` as a system message; a cut
    budget is an "incomplete" response."""
    client = server.client()
    r = client.responses.create(model="mirror", input="weather?", max_output_tokens=12, temperature=0)
    assert r.output_text == server.refs["plain"].text and r.status == "incomplete"  # 12 tokens, no end
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12
    assert r.usage.input_tokens == _tokens(server, [{"role": "user", "content": "weather?"}])
    assert r.output[0].type == "message" and r.output[0].role == "assistant" and r.id.startswith("resp_")
    r = client.responses.create(model="mirror", instructions="Be brief.", max_output_tokens=12, temperature=0,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]}])
    assert r.output_text == server.refs["instructed"].text
    text = server.refs["plain"].text
    stop = text[len(text) // 2: len(text) // 2 + 2]  # vLLM's extras pass through: a stop string ends it
    done = client.responses.create(model="mirror", input="weather?", max_output_tokens=200, temperature=0,
                                   extra_body={"stop": [stop]})
    assert done.status == "completed" and done.incomplete_details is None
    assert done.output_text == text[:text.index(stop)]


def test_the_stream_makes_the_same_response(server):
    """Typed events in order (created, in_progress, item and part added, text deltas, done events, completed):
    the deltas make the text, and the last event's response is the non-streaming one (ids aside). The openai
    client's stream helper accumulates a completed one into the same response."""
    client = server.client()
    kw = dict(model="mirror", input="weather?", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw).model_dump()
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # the budget cut it
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole["output"][0][
        "content"][0]["text"]
    assert _strip(events[-1].response.model_dump()) == _strip(whole)
    text = whole["output"][0]["content"][0]["text"]
    stop = {"stop": [text[len(text) // 2: len(text) // 2 + 2]]}
    with client.responses.stream(**kw, extra_body=stop) as st:  # completed: a stop string ends it
        final = st.get_final_response()
    assert final.status == "completed"
    assert final.output_text == client.responses.create(**kw, extra_body=stop).output_text


def test_log_probabilities(server):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the output text's tokens with their
    log-probabilities and alternatives, the chat's for the same messages; streamed on the text deltas, the same
    list; vLLM's `return_tokens_as_token_ids` names them by id (here, in chat and in streamed completions); with
    tools, or another include, a 400."""
    client = server.client()
    kw = dict(model="mirror", input="weather?", max_output_tokens=8, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    r = client.responses.create(**kw).model_dump()
    chat = client.chat.completions.create(model="mirror", messages=[{"role": "user", "content": "weather?"}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    lps = r["output"][0]["content"][0]["logprobs"]
    want = chat.choices[0].logprobs.model_dump()["content"]
    assert [(x["token"], len(x["top_logprobs"])) for x in lps] == [(x["token"], 2) for x in want]
    assert [x["logprob"] for x in lps] == pytest.approx([x["logprob"] for x in want], abs=1e-5)
    events = list(client.responses.create(**kw, stream=True))
    streamed = [x.model_dump() for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    assert [x["token"] for x in streamed] == [x["token"] for x in lps] and len(lps) == 8
    assert _strip(events[-1].response.model_dump()) == _strip(r)
    assert not client.responses.create(model="mirror", input="weather?", max_output_tokens=4).output[0].content[
        0].logprobs
    # vLLM's return_tokens_as_token_ids: the same entries, tokens named by id (chat, completions and here)
    ids = client.responses.create(**kw, extra_body={"return_tokens_as_token_ids": True}).model_dump()
    named = ids["output"][0]["content"][0]["logprobs"]
    tok = server.tokenizer
    assert [tok.decode([int(x["token"].split(":")[1])], skip_special_tokens=False) for x in named] == [
        x["token"] for x in lps]
    assert all(t["token"].startswith("token_id:") for x in named for t in x["top_logprobs"])
    c = client.chat.completions.create(model="mirror", messages=[{"role": "user", "content": "weather?"}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True})
    assert [x.token for x in c.choices[0].logprobs.content] == [x["token"] for x in named]
    comp = client.completions.create(model="mirror", prompt="weather?", max_tokens=4, temperature=0, logprobs=1,
                                     extra_body={"return_tokens_as_token_ids": True}, stream=True)
    assert all(t.startswith("token_id:") for ch in comp if ch.choices[0].logprobs
               for t in ch.choices[0].logprobs.tokens)
    for extra, param in (({"tools": FLAT}, "top_logprobs"), ({"include": ["reasoning.encrypted_content"]}, "include")):
        resp = httpx.post(server.url + "/v1/responses", json={**kw, **extra}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_tools_and_text_formats_map_onto_the_chats(server):
    """A named function tool: a function_call item whose arguments are offline guided decoding's under its schema,
    streamed as argument deltas; "auto" (hermes) reads content and calls back; text.format json_schema is
    guided decoding."""
    client = server.client()
    kw = dict(model="mirror", input="add?", tools=FLAT, tool_choice={"type": "function", "name": "add"},
              temperature=0, max_output_tokens=150)
    r = client.responses.create(**kw)
    assert [(it.type, it.name, it.arguments) for it in r.output] == [("function_call", "add",
                                                                      server.refs["add"].text)]
    assert r.output[0].call_id.startswith("call_") and r.status == "completed"
    events = list(client.responses.create(**kw, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == server.refs["add"].text
    assert _strip(events[-1].response.model_dump()) == _strip(r.model_dump())
    auto = client.responses.create(model="mirror", input="weather?", tools=FLAT, temperature=0,
                                   max_output_tokens=250, extra_body={"guided_regex": HERMES_REGEX})
    assert [it.type for it in auto.output] == ["message", "function_call", "function_call"]
    assert auto.output[0].content[0].text == "Sure.\n" and auto.output[2].name == "add"
    js = client.responses.create(model="mirror", input="n?", temperature=0, max_output_tokens=40,
                                 text={"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}})
    assert js.output_text == server.refs["schema"].text and "n" in json.loads(js.output_text)


def test_previous_response_id_and_stored_responses(server):
    """A response continues a stored one: its prompt is the earlier input and output, then the new input (the
    earlier instructions not); earlier calls and their outputs given as input items reach the template as the
    chat's tool_calls and tool messages. GET returns a stored response; unknown, unstored or deleted ids are
    404s."""
    client = server.client()
    first = client.responses.create(model="mirror", input="weather?", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model="mirror", input="and tomorrow?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    history = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "and tomorrow?"}]
    assert second.usage.input_tokens == _tokens(server, history)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    calls = [{"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_7", "output": "sunny"}]
    third = client.responses.create(model="mirror", input=[{"role": "user", "content": "weather?"}] + calls,
                                    tools=FLAT, tool_choice="none", max_output_tokens=4, temperature=0)
    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_7", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}]
    assert third.usage.input_tokens == _tokens(server, chat, TOOLS)
    unstored = client.responses.create(model="mirror", input="x", store=False, max_output_tokens=2)
    client.responses.delete(third.id)  # DELETE forgets a stored response
    for rid in ("resp_nope", unstored.id, third.id):
        r = httpx.get(f"{server.url}/v1/responses/{rid}", timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    r = httpx.post(server.url + "/v1/responses", json={"model": "mirror", "input": "x",
                                                       "previous_response_id": "resp_nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_bad_responses_requests(server):
    bad = [({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input"),
           ({"input": [{"role": "tool", "content": "x"}]}, 400, "input"),
           ({"input": []}, 400, "input"),
           ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
           ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input"),
           ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text"),
           ({"input": "x", "background": True, "store": False}, 400, "background"),
           ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
           ({"input": "x", "tool_choice": {"type": "mcp"}, "tools": FLAT}, 400, "tool_choice"),
           ({"input": "x", "max_output_tokens": 0}, 400, None),
           ({"input": 5}, 422, "input"),
           ({"input": "x", "model": "other"}, 404, "model")]
    for body, status, param in bad:
        r = httpx.post(server.url + "/v1/responses", json={"model": "mirror", **body}, timeout=60)
        assert r.status_code == status, (body, r.text)
        if param is not None:
            assert r.json()["error"]["param"] == param, (body, r.text)


def test_background_responses_cancel_and_input_items(server):
    """`background: true`: the reply comes at once ("queued"), and the stored response, polled, ends as the
    foreground one does (the same text); a long one is cancelled ("cancelled", its KV blocks freed); a finished one
    comes back as it is; a foreground one cannot be cancelled (400); background needs store and no stream (400s).
    `GET /v1/responses/{id}/input_items` lists the response's own input as items (the openai client's pager), newest
    first or in order, a page at a time."""
    import time
    client = server.client()
    kw = dict(model="mirror", input="weather?", max_output_tokens=12, temperature=0)
    fg = client.responses.create(**kw)
    bg = client.responses.create(**kw, background=True)
    assert bg.status in ("queued", "in_progress") and bg.background and not bg.output
    deadline = time.monotonic() + 60
    while (r := client.responses.retrieve(bg.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (r.status, r.output_text, r.usage.output_tokens) == (fg.status, fg.output_text, fg.usage.output_tokens)
    assert client.responses.cancel(bg.id).status == r.status  # ended: as it is
    aborted = server.metrics()["eyas:request_success_total{finish_reason=abort}"]
    long = client.responses.create(model="mirror", input="weather?", max_output_tokens=480, temperature=0,
                                   background=True, extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    m = server.wait_idle()  # nothing runs and no KV block is held
    assert m["eyas:request_success_total{finish_reason=abort}"] == aborted + 1  # stopped, not run to its end
    r = httpx.post(f"{server.url}/v1/responses/{fg.id}/cancel", timeout=60)
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]
    for body in ({"background": True, "store": False}, {"background": True, "stream": True}):
        r = httpx.post(server.url + "/v1/responses", json={"model": "mirror", "input": "x", **body}, timeout=60)
        assert r.status_code == 400, r.text
    items = [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "add",
                                                 "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "3"},
             {"role": "user", "content": "bye"}]
    resp = client.responses.create(model="mirror", input=items, instructions="Be brief.", max_output_tokens=2,
                                   temperature=0)
    listed = list(client.responses.input_items.list(resp.id))  # newest first
    assert [it.type for it in listed] == ["message", "function_call_output", "function_call", "message"]
    assert listed[0].content[0].text == "bye" and listed[2].call_id == "c1" and listed[1].output == "3"
    page = client.responses.input_items.list(resp.id, order="asc", limit=2)
    assert [it.id for it in page.data] == [it.id for it in reversed(listed)][:2] and page.has_more
    rest = client.responses.input_items.list(resp.id, order="asc", limit=2, after=page.data[-1].id)
    assert [it.id for it in rest.data] == [it.id for it in reversed(listed)][2:] and not rest.has_more
    r = httpx.get(f"{server.url}/v1/responses/{resp.id}/input_items", params={"limit": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
