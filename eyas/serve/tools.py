"""Tool calling: OpenAI's `tools` and `tool_choice` on /v1/chat/completions, as vLLM serves them.

What the model writes, by `tool_choice`:
* `{"type": "function", "function": {"name": f}}` (named): f's arguments, guided by f's `parameters` schema
  (`eyas.spec.grammar`). The reply is one call of f whose arguments are the output's text; `finish_reason` is
  "stop", as OpenAI gives for a forced function.
* "required": a JSON array of one or more `{"name": <a tool's name>, "parameters": <its arguments>}` (vLLM's
  schema; one item at most with `parallel_tool_calls: false`), guided; each item becomes a call, and
  `finish_reason` is "tool_calls" (or "length" where max_tokens cut the array: its finished items are the calls).
* "auto" (the default when tools are given): free text, which the server's tool-call parser (`eyas serve
  --enable-auto-tool-choice --tool-call-parser NAME`: hermes, llama3_json or mistral) reads back: text before the
  calls is the reply's `content`.
  Without a parser, "auto" with tools is a 400, as in vLLM.
* "none": free text, never read as calls.
The tools always reach the chat template (its `tools` variable), so a template that knows them shows them to the
model. Guided calls are exact like any guided output: under speculation too, greedy equals plain decoding.

Streaming: a named call streams its arguments as they are written; a "required" call is sent whole as soon as its
array item closes; an "auto" call goes out once its name is written, then its arguments as they are written (as
vLLM streams them; the text before the calls streams as content while it cannot be the start of one). Both make
the same message as the non-streaming reply (`ToolStream`, used by both): an "auto" call's arguments are the text
the model wrote (a string's value, where it wrote them as a string), and a call cut short by `max_tokens` keeps what
was written, with finish_reason "length" (OpenAI's way). An output in which no call's name could be read is
content, all of it.
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

class CallScanner:
    """One tool call's JSON object as its text grows, a character at a time: its function's `name` once that string
    closes, and `arguments()`, the text of its arguments (its "arguments" or "parameters" value) as far as it is
    written: an object, array or number as the model wrote it (so a stream can send it while it grows), a string's
    value once it closes (a model that writes the arguments as JSON text), "{}" for an object that closed without
    them. A text that is not such an object turns it `bad` (what it read stays)."""
    ARGS = ("arguments", "parameters")

    def __init__(self):
        self.state = "start"  # start key keystr colon value namestr val after done bad
        self.buf, self.key, self.name = "", None, None
        self.esc = self.in_str = False
        self.depth = 0
        self.raw: str | None = None  # the arguments' text so far (None: no arguments key yet)
        self.target = False  # the value being read is the arguments'
        self.args_closed = False

    @property
    def done(self) -> bool:
        return self.state in ("done", "bad")

    def arguments(self) -> str:
        if self.raw is None:
            return "{}" if self.state == "done" else ""
        if self.raw.startswith('"'):  # a string: its value, once whole
            if not self.args_closed:
                return ""
            try:
                return json.loads(self.raw)
            except ValueError:
                return ""
        return self.raw

    def _string(self, c: str) -> bool:
        """Reads one character of a key or the name; True once the string closed (`buf` holds its raw text)."""
        if self.esc:
            self.esc = False
        elif c == "\\":
            self.esc = True
        elif c == '"':
            return True
        self.buf += c
        return False

    def _decode(self) -> str | None:
        try:
            return json.loads('"' + self.buf + '"')
        except ValueError:
            return None

    def feed(self, text: str) -> None:
        for c in text:
            self._char(c)

    def _char(self, c: str) -> None:
        st = self.state
        if st in ("done", "bad"):
            return
        if st in ("keystr", "namestr"):
            if self._string(c):
                value = self._decode()
                if value is None:
                    self.state = "bad"
                elif st == "keystr":
                    self.key, self.state = value, "colon"
                else:
                    self.name = self.name if self.name is not None else value
                    self.state = "after"
            return
        if st == "val":
            self._value(c)
            return
        if c.isspace():
            return
        if st == "start":
            self.state = "key" if c == "{" else "bad"
        elif st == "key":
            if c == '"':
                self.buf, self.state = "", "keystr"
            else:
                self.state = "done" if c == "}" else "bad"
        elif st == "colon":
            self.state = "value" if c == ":" else "bad"
        elif st == "after":
            self.state = {",": "key", "}": "done"}.get(c, "bad")
        elif st == "value":
            if self.key == "name":
                if c == '"' and self.name is None:
                    self.buf, self.state = "", "namestr"
                else:
                    self.state = "bad"
                return
            self.target = self.key in self.ARGS and self.raw is None
            if self.target:
                self.raw = ""
            self.depth, self.in_str, self.esc, self.state = 0, False, False, "val"
            self._value(c)

    def _value(self, c: str) -> None:
        """One character of a value (nesting and strings followed); its end moves on to `after`."""
        ends = False
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                ends = self.depth == 0
        elif c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]" or (c == "," and self.depth == 0):
            if self.depth == 0:  # a number, true, false or null ends where its object goes on
                self._end_value()
                self._char(c)
                return
            self.depth -= 1
            ends = self.depth == 0
        if self.target and not (c.isspace() and self.depth == 0 and not self.in_str):  # a number's trailing space
            self.raw += c
        if ends:
            self._end_value()

    def _end_value(self) -> None:
        if self.target:
            self.args_closed, self.target = True, False
        self.state = "after"


class CallReader:
    """The tool calls of one output as its text grows (`ToolParser.reader`): `feed(text)` scans the text added since
    the last call, `finish()` the rest once the output ended; `calls` are the `CallScanner`s so far, and `start` is
    where the first call begins (None: no call yet), which ends the content."""

    def __init__(self, parser: "ToolParser"):
        self.parser = parser
        self.calls: list[CallScanner] = []
        self.start: int | None = None
        self.pos = 0  # how far the text was scanned
        self.hold = ""  # characters that may begin a tag, not scanned yet
        self.state = "content"

    def feed(self, text: str, final: bool = False) -> None:
        if self.start is None:
            self.start = self.parser.first_call(text, final)
            if self.start is None:
                return
            self.pos, self.state = self.start, "call"
            self.calls.append(CallScanner())
        for c in text[self.pos:]:
            self.parser.step(self, c)
        self.pos = len(text)
        if final and self.hold:
            held, self.hold = self.hold, ""
            if self.state == "call":
                self.calls[-1].feed(held)


class ToolParser:
    """How tool calls sit in a model's free text. `content_end(text)`: how much of a text still being written is
    content whatever follows (what a stream may send now); `first_call(text, final)`: where the first call's object
    begins, once known (None before); `step(reader, c)`: one character after it (framing between calls)."""
    name = ""

    def reader(self) -> CallReader:
        return CallReader(self)

    def content_end(self, text: str) -> int:
        raise NotImplementedError

    def first_call(self, text: str, final: bool) -> int | None:
        raise NotImplementedError

    def step(self, r: CallReader, c: str) -> None:
        raise NotImplementedError


def _before_tag(text: str, tag: str) -> int:
    """How much of `text` comes before `tag` whatever follows: up to the tag, or to where it may be starting."""
    at = text.find(tag)
    if at >= 0:
        return at
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class HermesParser(ToolParser):
    """Hermes 2 Pro, Qwen 2.5 and 3, SmolLM3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
    number of them after the content; the last may lack its closing tag. A call's text ends at its closing tag
    (whatever its JSON), and text between calls is not read."""
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def content_end(self, text):
        return _before_tag(text, self.START)

    def first_call(self, text, final):
        at = text.find(self.START)
        return None if at < 0 else at + len(self.START)

    def step(self, r, c):
        tag = self.END if r.state == "call" else self.START  # "seek": between calls
        r.hold += c
        while r.hold and not tag.startswith(r.hold):
            if r.state == "call":
                r.calls[-1].feed(r.hold[0])
            r.hold = r.hold[1:]
        if r.hold == tag:
            r.hold = ""
            if r.state == "call":
                r.state = "seek"
            else:
                r.state = "call"
                r.calls.append(CallScanner())


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3's JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (or "arguments"),
    several separated by ";", after an optional `<|python_tag|>`; an output that begins otherwise is content. After
    the calls, text that is not another call is not read."""
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def content_end(self, text):
        s = text.lstrip()
        if not s or s.startswith("{") or s.startswith(self.TAG) or self.TAG.startswith(s):
            return 0  # a call may be what this text is: nothing is content yet
        return len(text)

    def first_call(self, text, final):
        s = text.lstrip()
        at = len(text) - len(s)
        if s.startswith(self.TAG):
            rest = s[len(self.TAG):]
            t = rest.lstrip()
            if not t:
                return None
            return at + len(self.TAG) + len(rest) - len(t) if t.startswith("{") else None
        return at if s.startswith("{") else None

    def step(self, r, c):
        _objects(r, c, ";")


class MistralParser(ToolParser):
    """Mistral's tool calls (Mistral 7B Instruct v0.3, Mixtral, Mistral Small / Nemo): `[TOOL_CALLS]` then a JSON
    array of `{"name": ..., "arguments": {...}}`, after the content. After the array, text is not read."""
    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def content_end(self, text):
        return _before_tag(text, self.TAG)

    def first_call(self, text, final):
        at = text.find(self.TAG)
        if at < 0:
            return None
        rest = text[at + len(self.TAG):]
        body = rest.lstrip()
        if not body:
            return None
        if not body.startswith("["):  # not the array: no calls
            return None
        inner = body[1:].lstrip()
        if not inner:
            return None
        return len(text) - len(inner)

    def step(self, r, c):
        _objects(r, c, ",")


def _objects(r: CallReader, c: str, sep: str) -> None:
    """One character of a run of call objects separated by `sep` (and spaces); anything else ends the calls."""
    if r.state == "call":
        r.calls[-1].feed(c)
        if r.calls[-1].done:
            r.state = "seek" if r.calls[-1].state == "done" else "end"
    elif r.state == "seek":
        if c == "{":
            r.state = "call"
            r.calls.append(CallScanner())
            r.calls[-1].feed(c)
        elif not (c.isspace() or c == sep):
            r.state = "end"


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


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
        self.reader = parser.reader() if choice == "auto" else None
        self.emitted: dict[int, list] = {}  # "auto": per call that went out (by its scanner), [index, arguments sent]

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
            out = []
            end = self.parser.content_end(self.text)
            if end > self.sent and self.text[:end].strip():
                out.append({"content": self.text[self.sent:end]})
                self.sent = end
            self.reader.feed(self.text)
            return out + self._call_deltas()
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
        self.reader.feed(self.text, final=True)
        calls = self._call_deltas()
        if not self.emitted:  # no call: the text is content, all of it (what is left of it)
            return ([{"content": self.text[self.sent:]}] if self.text[self.sent:] else []), reason
        return calls, ("tool_calls" if reason == "stop" else reason)

    def _call_deltas(self) -> list[dict]:
        """"auto": a call goes out once its name is known, then its arguments as they grow."""
        out = []
        for sc in self.reader.calls:
            if sc.name is None:
                continue
            args = sc.arguments()
            sent = self.emitted.get(id(sc))
            if sent is None:
                self.emitted[id(sc)] = [len(self.emitted), len(args)]
                out.append({"tool_calls": [{"index": len(self.emitted) - 1, **call(sc.name, args)}]})
            elif len(args) > sent[1]:
                out.append({"tool_calls": [{"index": sent[0], "function": {"arguments": args[sent[1]:]}}]})
                sent[1] = len(args)
        return out

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        deltas = self.feed(text)
        last, reason = self.finish(reason)
        return merge_deltas(deltas + last), reason


def merge_deltas(deltas: list[dict]) -> dict:
    """A reply's chat deltas (a stream's pieces) as its whole message: content, tool calls, and a reasoning model's
    thinking (`eyas.serve.reasoning`). Content is None where calls or thinking came without it, else a string."""
    content, calls, reasoning = None, [], None
    for d in deltas:
        if "content" in d:
            content = (content or "") + d["content"]
        if "reasoning" in d:
            reasoning = (reasoning or "") + d["reasoning"]
        for c in d.get("tool_calls", []):
            if "id" in c:
                calls.append({"id": c["id"], "type": c["type"], "function": dict(c["function"])})
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    msg = {"role": "assistant", "content": content if calls or reasoning else content or ""}
    if reasoning:
        msg["reasoning"] = msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg
