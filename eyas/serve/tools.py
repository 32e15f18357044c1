"""Tool calling: OpenAI's `tools` and `tool_choice` on /v1/chat/completions, as vLLM serves them.

What the model writes, by `tool_choice`:
* `{"type": "function", "function": {"name": f}}` (named): f's arguments, guided by f's `parameters` schema
  (`eyas.spec.grammar`). The reply is one call of f whose arguments are the output's text; `finish_reason` is
  "stop", as OpenAI gives for a forced function.
* "required": a JSON array of one or more `{"name": <a tool's name>, "parameters": <its arguments>}` (vLLM's
  schema; one item at most with `parallel_tool_calls: false`), guided; each item becomes a call, and
  `finish_reason` is "tool_calls" (or "length" where max_tokens cut the array: its finished items are the calls).
* "auto" (the default when tools are given): free text, which the server's tool-call parser (`eyas serve
  --enable-auto-tool-choice --tool-call-parser NAME`) reads back: text before the calls is the reply's `content`.
  Without a parser, "auto" with tools is a 400, as in vLLM.
* "none": free text, never read as calls.
The tools always reach the chat template (its `tools` variable), so a template that knows them shows them to the
model. Guided calls are exact like any guided output: under speculation too, greedy equals plain decoding.

Streaming: a named call streams its arguments as they are written; a "required" call is sent whole as soon as its
array item closes, an "auto" call once the output ends (the text before it streams as content while it cannot be
the start of one). Both make the same message as the non-streaming reply (`ToolStream`, used by both).
"""
from __future__ import annotations

import json
import re
import uuid

from eyas.sampling_params import GuidedDecoding

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, arguments: str) -> dict:
    """One entry of a message's `tool_calls`."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _dump(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


# ---- what a request asks for ---------------------------------------------------------------------------------------

def check_tools(names: list[str]) -> None:
    """ValueError for a function name OpenAI refuses or one given twice (`names`: the tools' function names)."""
    seen = set()
    for name in names:
        if not NAME.fullmatch(name):
            raise ValueError(f"tool names must match [A-Za-z0-9_-]{{1,64}}, got {name!r}")
        if name in seen:
            raise ValueError(f"tool {name!r} is given twice")
        seen.add(name)


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """vLLM's schema for `tool_choice: "required"`: an array of calls, each one of the tools with its arguments."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or {"type": "object", "properties": {}}},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_guide(tools: list[dict], choice, parallel: bool = True) -> GuidedDecoding | None:
    """The guide a tool choice puts on the output: a named function's parameters, "required"'s array, else None.
    `choice`: "none", "auto", "required" or the function's name (a named choice)."""
    if choice == "required":
        return GuidedDecoding(json=required_schema(tools, parallel))
    if choice in ("none", "auto"):
        return None
    tool = next(t for t in tools if t["function"]["name"] == choice)
    return GuidedDecoding(json=tool["function"].get("parameters") or {"type": "object", "properties": {}})


class ArrayItems:
    """The items of a JSON array as its text grows: `feed(text)` returns the items that closed in it (parsed), so
    a "required" output's calls go out one by one. It follows strings (and their escapes) and nesting only: the
    array is the guide's, so well formed as far as it goes."""

    def __init__(self):
        self.buf, self.depth, self.in_str, self.esc, self.start = "", 0, False, False, None

    def feed(self, text: str) -> list:
        items = []
        for ch in text:
            self.buf += ch
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.start = len(self.buf) - 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self.start is not None:
                    items.append(json.loads(self.buf[self.start:]))
                    self.start = None
        return items


def required_call(item) -> dict:
    """The call of one item of a "required" output's array."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "parameters" not in item:
        raise ValueError(f"not a call: {item!r}")
    return call(item["name"], _dump(item["parameters"]))


def template_tool_calls(calls: list[dict]) -> list[dict]:
    """A request's assistant `tool_calls` as chat templates read them: each function's `arguments` as an object
    where it is JSON text (HF's templates write `arguments | tojson`; vLLM passes them so too)."""
    out = []
    for c in calls:
        c = dict(c)
        fn = c.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                c["function"] = {**fn, "arguments": json.loads(fn["arguments"])}
            except ValueError:
                pass
        out.append(c)
    return out


# ---- parsers of free text ("auto") ---------------------------------------------------------------------------------

class ToolParser:
    """Reads tool calls out of a model's free text. `parse(text)`: (content or None, calls), calls empty when the
    text holds none (then content is the whole text). `content_end(text)`: how much of a text still being written
    is content whatever follows (what a stream may send now)."""
    name = ""

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        raise NotImplementedError


class HermesParser(ToolParser):
    """Hermes 2 Pro, Qwen 2.5 and 3, SmolLM3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
    number of them after the content; the last may lack its closing tag."""
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def parse(self, text):
        at = text.find(self.START)
        if at < 0:
            return text, []
        calls = []
        for m in self._CALL.finditer(text, at):
            try:
                obj = json.loads(m.group(1) if m.group(1) is not None else m.group(2))
            except ValueError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            calls.append(call(obj["name"], _dump(obj.get("arguments", {}))))
        content = text[:at]
        return (content if content.strip() else None), calls

    def content_end(self, text):
        at = text.find(self.START)
        if at >= 0:
            return at
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):  # a tag may be starting at the end
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3's JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}` (or
    "arguments"), several separated by ";", after an optional `<|python_tag|>`. Anything else is content."""
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text):
        s = text.strip()
        if s.startswith(self.TAG):
            s = s[len(self.TAG):].lstrip()
        if not s.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(s):
            try:
                obj, i = decoder.raw_decode(s, i)
            except ValueError:
                return text, []
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not isinstance(args, dict):
                return text, []
            calls.append(call(obj["name"], _dump(args)))
            while i < len(s) and (s[i].isspace() or s[i] == ";"):
                i += 1
        return None, calls

    def content_end(self, text):
        s = text.lstrip()
        if not s or s.startswith("{") or s.startswith(self.TAG) or self.TAG.startswith(s):
            return 0  # a call may be what this text is: nothing is content yet
        return len(text)


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def make_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {sorted(PARSERS)}")
    return PARSERS[name]()


# ---- one choice's reply --------------------------------------------------------------------------------------------

class ToolStream:
    """One choice's reply under a tool choice, from its text as it grows: `feed(delta)` gives the chat deltas a
    stream sends now (`{"content": ...}` or `{"tool_calls": [...]}`), `finish(reason)` the last ones and the
    choice's finish_reason. `message(text, reason)` is the non-streaming reply, made by the same calls."""

    def __init__(self, choice: str, parser: ToolParser | None = None):
        self.choice, self.parser = choice, parser  # choice: "required", "auto" or a function's name
        self.text, self.sent = "", 0  # the output so far; how much of it went out as content (auto)
        self.head: dict | None = None  # a named call, once its first part went out
        self.items = ArrayItems() if choice == "required" else None
        self.calls_sent = 0  # "required": the calls that went out

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        if not delta:
            return []
        if self.choice == "required":
            if self.items is None:
                return []
            try:
                calls = [required_call(x) for x in self.items.feed(delta)]
            except ValueError:  # not the guide's array (a cut-short guide cannot write one): read no further
                self.items = None
                return []
            out = [{"tool_calls": [{"index": self.calls_sent + k, **c}]} for k, c in enumerate(calls)]
            self.calls_sent += len(calls)
            return out
        if self.choice == "auto":
            end = self.parser.content_end(self.text)
            if end > self.sent and self.text[:end].strip():
                out, self.sent = self.text[self.sent:end], end
                return [{"content": out}]
            return []
        if self.head is None:
            self.head = call(self.choice, delta)
            return [{"tool_calls": [{"index": 0, **self.head}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}]

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        if self.choice not in ("required", "auto"):  # named: its call, even if the output was empty
            return ([] if self.head is not None else
                    [{"tool_calls": [{"index": 0, **call(self.choice, "")}]}]), reason
        if self.choice == "required":  # its calls went out as their items closed
            if self.calls_sent:
                return [], ("tool_calls" if reason == "stop" else reason)
            return ([{"content": self.text}] if self.text else []), reason
        content, calls = self.parser.parse(self.text)
        out = []
        rest = (content or "")[self.sent:]  # content not sent yet: all of it, or what followed the last delta
        if rest:
            out.append({"content": rest})
        if not calls:
            return out, reason
        out.append({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
        return out, "tool_calls"

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        deltas = self.feed(text)
        last, reason = self.finish(reason)
        content, calls = None, []
        for d in deltas + last:
            if "content" in d:
                content = (content or "") + d["content"]
            for c in d.get("tool_calls", []):
                if "id" in c:
                    calls.append({"id": c["id"], "type": c["type"], "function": dict(c["function"])})
                else:
                    calls[-1]["function"]["arguments"] += c["function"]["arguments"]
        msg = {"role": "assistant", "content": content if calls else content or ""}
        if calls:
            msg["tool_calls"] = calls
        return msg, reason
