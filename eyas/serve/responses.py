"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`, `POST .../cancel`, `GET
.../input_items`), as vLLM serves it for text models.

A request is read as a chat completion (`chat_body`): `input` (a string, or items: messages whose content is a
string or `input_text` / `output_text` parts, earlier `function_call`s and their `function_call_output`s) becomes
the messages, `instructions` a system message first, `max_output_tokens` the token budget, `text.format` the
response format (`json_schema`, `json_object`), and `tools` (Responses' flat function tools) and `tool_choice` the
chat's. So everything a chat request does holds here too: guided tool calls, exact speculation, the vLLM sampling
extensions (`seed`, `top_k`, `stop`, ...) passed through. The reply's `output` (`output_items`) is a `message`
item with the text, and a `function_call` item per call; `status` is "incomplete" (`max_output_tokens`) where the
budget cut it.

`previous_response_id` continues a stored response: its input and output come before the new input (its
instructions do not, as OpenAI's). Responses are stored (`store`, default true) in memory, the last
`ResponseStore.capacity` of them, for that and for `GET /v1/responses/{id}`; an id that is not (or no longer) held
is a 404.

Streaming (`stream: true`) sends OpenAI's typed events (`ResponseEvents`): `response.created`,
`response.in_progress`, then per output item `response.output_item.added`, its text's
`response.content_part.added`, `response.output_text.delta`s, `response.output_text.done` and
`response.content_part.done` (or a call's `response.function_call_arguments.delta`s and `.done`),
`response.output_item.done`, and last `response.completed` (or `response.incomplete`) with the whole response,
which equals the non-streaming reply (ids aside).

`background: true` (stored, not streamed) answers at once with the response "queued"; the stored one moves to
"in_progress" and then to its end as the engine works (`eyas.serve.api_server._background`), and `POST
/v1/responses/{id}/cancel` stops it ("cancelled"). `GET /v1/responses/{id}/input_items` pages through a stored
response's own input as items (`input_items`)."""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Literal

from pydantic import StrictBool, StrictFloat, StrictInt

from eyas.serve.protocol import APIError, _Request

LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for the text's log-probabilities

# the Responses fields that have no chat counterpart of the same name (the rest pass through to the chat request)
OWN_FIELDS = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "previous_response_id",
              "store", "metadata", "background", "include", "truncation", "reasoning", "stream", "stream_options",
              "messages", "max_tokens", "max_completion_tokens", "response_format", "n", "logprobs", "top_logprobs",
              "prompt_logprobs"}


class ResponsesRequest(_Request):
    model: str
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool = False
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: StrictBool = True
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    previous_response_id: str | None = None
    store: StrictBool = True
    metadata: dict | None = None
    background: StrictBool = False
    top_logprobs: StrictInt | None = None  # with include's "message.output_text.logprobs" (or alone): k alternatives
    include: list[str] | None = None


def _text(content, param: str) -> str:
    """A message's content: a string, or text parts (`input_text`, `output_text`, `text`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"a message's content must be a string or a list of text parts, got {content!r}", param=param)
    out = []
    for p in content:
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(p.get("text"), str):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise APIError(f"only text parts are supported in a message's content, got {kind!r}", param=param)
        out.append(p["text"])
    return "".join(out)


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages: a string is the user's; items are messages, calls (an assistant's tool_calls, those
    in a row in one message) and call outputs (tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    thought = None  # a reasoning item's text: the thinking of the assistant turn that follows it
    for k, it in enumerate(items):
        kind = it.get("type", "message")
        if kind == "reasoning":
            parts = it.get("content") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise APIError(f"input[{k}]: a reasoning item's content must be a list of reasoning_text parts",
                               param="input")
            thought = (thought or "") + "".join(p["text"] for p in parts)
            continue
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"input[{k}]: role must be user, system, developer or assistant, got {role!r}",
                               param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(it.get("content"), "input")})
            if role == "assistant" and thought is not None:
                messages[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call":
            if not all(isinstance(it.get(f), str) for f in ("call_id", "name", "arguments")):
                raise APIError(f"input[{k}]: a function_call needs call_id, name and arguments (strings)",
                               param="input")
            c = {"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                       "arguments": it["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(c)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [c]})
            if thought is not None:
                messages[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str) or not isinstance(it.get("output"), str):
                raise APIError(f"input[{k}]: a function_call_output needs call_id and output (strings)",
                               param="input")
            messages.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
        else:
            raise APIError(f"input[{k}]: items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output, reasoning)", param="input")
    if not messages:
        raise APIError("input must hold at least one item", param="input")
    return messages


def _tools(req: ResponsesRequest) -> tuple[list[dict] | None, object]:
    """Responses' flat function tools and tool_choice, as the chat's."""
    tools = None
    if req.tools is not None:
        tools = []
        for t in req.tools:
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise APIError("only function tools ({\"type\": \"function\", \"name\", \"parameters\"}) are "
                               f"supported, got {t!r}", param="tools")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                               "strict") if t.get(k) is not None}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"name\"}}, got "
                           f"{choice!r}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _format(req: ResponsesRequest) -> dict | None:
    """`text.format` as the chat's response_format."""
    fmt = (req.text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise APIError(f"text.format type must be text, json_object or json_schema, got {fmt.get('type')!r}",
                   param="text")


def chat_body(req: ResponsesRequest, body: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """The chat completion request that answers `req` (`body`: its JSON, whose other fields pass through), with
    `history` (a previous response's messages) before its input; and the messages a later response continues
    (history and input, not the instructions)."""
    if req.background and not req.store:
        raise APIError("background responses must be stored (store: true): they are read back by id",
                       param="background")
    if req.background and req.stream:
        raise APIError("background responses are not streamed here: poll GET /v1/responses/{id}", param="stream")
    unknown = set(req.include or ()) - {LOGPROBS}
    if unknown:
        raise APIError(f"include: only {LOGPROBS!r} is supported, got {sorted(unknown)}", param="include")
    logprobs = req.top_logprobs is not None or LOGPROBS in (req.include or ())
    if logprobs and req.tools:
        raise APIError("log-probabilities with tools are not supported", param="top_logprobs")
    kept = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + kept
    tools, choice = _tools(req)
    chat = {k: v for k, v in body.items() if k not in OWN_FIELDS}
    chat.update(messages=messages, max_completion_tokens=req.max_output_tokens, tools=tools, tool_choice=choice,
                response_format=_format(req), stream=False)
    if logprobs:
        chat.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return chat, kept


# ---- the reply -------------------------------------------------------------------------------------------------------

def message_item(text: str, status: str = "completed", item_id: str | None = None,
                 logprobs: list | None = None) -> dict:
    """A message output item; `logprobs`: its tokens' (chat's `logprobs.content` entries: token, logprob, bytes,
    top_logprobs), [] unless asked for."""
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}]}


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """A reasoning model's thinking (`eyas.serve.reasoning`) as an output item: its text whole, no summary."""
    return {"type": "reasoning", "id": item_id or new_id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}


def output_items(message: dict, status: str = "completed", logprobs: list | None = None) -> list[dict]:
    """A chat message (reasoning, content, tool_calls) as Responses' output items."""
    items = [reasoning_item(message["reasoning"], status)] if message.get("reasoning") else []
    items += [message_item(message["content"] or "", status, logprobs=logprobs)] \
        if message.get("content") or logprobs else []
    return items + [call_item(c, status) for c in message.get("tool_calls") or []]


def usage(prompt: int, completion: int, cached: int, reasoning: int = 0) -> dict:
    """`reasoning`: the output tokens that were a reasoning model's thinking."""
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + completion}


def response(rid: str, req: ResponsesRequest, created: int, output: list[dict], status: str,
             use: dict | None) -> dict:
    """The response object: `status` "in_progress", "completed" or "incomplete" (the budget ran out)."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": req.model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
            "text": req.text or {"format": {"type": "text"}}, "previous_response_id": req.previous_response_id,
            "store": req.store, "metadata": req.metadata or {}, "usage": use, "background": req.background,
            "truncation": "disabled", "reasoning": None, "user": None}


def status_of(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def input_items(messages: list[dict]) -> list[dict]:
    """A response's input (its chat messages, the instructions not among them) as the items `GET
    /v1/responses/{id}/input_items` lists: messages (`input_text` parts; an assistant's `output_text`), an
    assistant's thinking as a reasoning item, its calls as function_call items, tool messages as
    function_call_output items; each with an id of its own."""
    items = []
    for m in messages:
        if m.get("reasoning_content"):
            items.append({"type": "reasoning", "id": new_id("rs"), "summary": [],
                          "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "id": new_id("fco"), "call_id": m["tool_call_id"],
                          "output": m["content"], "status": "completed"})
            continue
        if m.get("content") or not m.get("tool_calls"):
            kind = "output_text" if m["role"] == "assistant" else "input_text"
            part = {"type": kind, "text": m.get("content") or ""}
            if kind == "output_text":
                part["annotations"] = []
            items.append({"type": "message", "id": new_id("msg"), "role": m["role"], "status": "completed",
                          "content": [part]})
        for c in m.get("tool_calls") or []:
            items.append(call_item(c))
    return items


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output as the chat messages a later response continues (`previous_response_id`)."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                    "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    thought = "".join(p["text"] for it in output if it["type"] == "reasoning" for p in it["content"])
    m = {"role": "assistant", "content": text or None}
    if calls:
        m["tool_calls"] = calls
    if thought:  # the template decides whether an earlier turn's thinking is shown again (Qwen3's: the last ones)
        m["reasoning_content"] = thought
    return [m]


class ResponseStore:
    """The last `capacity` stored responses, with the messages that continue each (its history, its input, its
    output) and its input items (`input_items`)."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._inputs: dict[str, list[dict]] = {}

    def put(self, resp: dict, messages: list[dict], inputs: list[dict] | None = None) -> None:
        """`inputs`: the response's own input messages (kept as items at the first put; a background response is
        put again when it ends)."""
        self._items[resp["id"]] = (resp, messages + output_messages(resp["output"]))
        if inputs is not None and resp["id"] not in self._inputs:
            self._inputs[resp["id"]] = input_items(inputs)
        while len(self._items) > self.capacity:
            old, _ = self._items.popitem(last=False)
            self._inputs.pop(old, None)

    def input_items(self, rid: str, order: str = "desc", limit: int = 20, after: str | None = None) -> dict:
        """OpenAI's list of a stored response's input items: newest first (`order` "desc") or oldest first, `limit`
        (1-100) of them after the item `after`."""
        self.get(rid)
        if order not in ("asc", "desc"):
            raise APIError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        if not 1 <= limit <= 100:
            raise APIError(f"limit must be an integer in [1, 100], got {limit}", param="limit")
        items = list(self._inputs.get(rid, []))
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise APIError(f"after: no input item {after!r} in response {rid!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        if rid not in self._items:
            raise APIError(f"Response with id {rid!r} not found.", status=404, param=param, code="not_found")
        return self._items[rid]

    def delete(self, rid: str) -> dict:
        self.get(rid)
        del self._items[rid]
        self._inputs.pop(rid, None)
        return {"id": rid, "object": "response", "deleted": True}


class ResponseEvents:
    """One response's stream events from its chat deltas (`ToolStream`'s, or text alone): items open as their
    first delta comes, and close, in order, at the end."""

    def __init__(self, rid: str, req: ResponsesRequest, created: int):
        self.rid, self.req, self.created = rid, req, created
        self.seq = 0
        self.items: list[dict] = []  # the output items so far (their text and arguments as they grow)
        self.text_item: int | None = None  # the message item's index
        self.thought_item: int | None = None  # the reasoning item's index
        self.call_items: dict[int, int] = {}  # a tool call's index -> its item's index

    def event(self, kind: str, **fields) -> str:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        r = response(self.rid, self.req, self.created, [], "in_progress", None)
        return [self.event("response.created", response=r), self.event("response.in_progress", response=r)]

    def _part_item(self, index: int | None, make) -> tuple[int, list[str]]:
        """The index of the item of one text part (`make`: `message_item` or `reasoning_item`), opened on its first
        delta: then also its `output_item.added` and `content_part.added` events."""
        if index is not None:
            return index, []
        index = len(self.items)
        item = make("", "in_progress")
        self.items.append(item)
        return index, [self.event("response.output_item.added", output_index=index, item={**item, "content": []}),
                       self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=item["content"][0])]

    def delta(self, d: dict, logprobs: list | None = None) -> list[str]:
        """The events of one chat delta; `logprobs`: the log-probabilities of the tokens its step wrote (they ride
        with its text, or with an empty delta where a stop string's beginning is held back)."""
        out = []
        if d.get("reasoning"):
            self.thought_item, opened = self._part_item(self.thought_item, reasoning_item)
            out += opened
            item = self.items[self.thought_item]
            item["content"][0]["text"] += d["reasoning"]
            out.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=self.thought_item, content_index=0, delta=d["reasoning"]))
        if d.get("content") or logprobs:
            self.text_item, opened = self._part_item(self.text_item, message_item)
            out += opened
            item = self.items[self.text_item]
            item["content"][0]["text"] += d.get("content", "")
            item["content"][0]["logprobs"] += logprobs or []
            out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.text_item,
                                  content_index=0, delta=d.get("content", ""), logprobs=logprobs or []))
        for c in d.get("tool_calls", []):
            if c["index"] not in self.call_items:
                self.call_items[c["index"]] = len(self.items)
                item = call_item({**c, "function": {**c["function"], "arguments": ""}}, "in_progress")
                self.items.append(item)
                out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
            k = self.call_items[c["index"]]
            args = c["function"].get("arguments", "")
            if args:
                self.items[k]["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta", item_id=self.items[k]["id"],
                                      output_index=k, delta=args))
        return out

    def finish(self, finish: str | None, use: dict) -> tuple[list[str], dict]:
        """The closing events, and the response they end with."""
        out = []
        status = "completed" if finish != "length" else "incomplete"
        for k, item in enumerate(self.items):
            item["status"] = status
            if item["type"] in ("message", "reasoning"):
                part = item["content"][0]
                if item["type"] == "message":
                    out.append(self.event("response.output_text.done", item_id=item["id"], output_index=k,
                                          content_index=0, text=part["text"], logprobs=part["logprobs"]))
                else:
                    out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=k,
                                          content_index=0, text=part["text"]))
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=k,
                                      content_index=0, part=part))
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                                      arguments=item["arguments"], name=item["name"]))
            out.append(self.event("response.output_item.done", output_index=k, item=item))
        r = response(self.rid, self.req, self.created, self.items, status, use)
        out.append(self.event("response.completed" if status == "completed" else "response.incomplete", response=r))
        return out, r


def new_id(prefix: str = "resp") -> str:
    """OpenAI's ids: resp_..., msg_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
