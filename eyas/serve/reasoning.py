"""Reasoning models' thinking apart from their answer: vLLM's `--reasoning-parser` (`deepseek_r1`, `qwen3`).

Such a model writes its thinking between `<think>` and `</think>` (each one token), then its answer. A chat reply
gets the thinking as `reasoning` (vLLM's field; `reasoning_content` too, its older name and DeepSeek's) and the
answer as `content`; a Responses reply gets a `reasoning` output item before its message. Tool calls are read from
the answer only, and a guide (`response_format`, the `guided_*` fields, a named or "required" tool choice) applies
to the answer only: the grammar starts after `</think>` (`GuidedDecoding.after_token_id`,
`eyas.spec.grammar.GatedGrammarState`), so the thinking is free and the answer follows the schema, under
speculation as without it.

Where the output starts, thinking or answering (`ReasoningParser.thinking`): the prompt's last tag decides (a
template that opened `<think>` in the prompt: thinking; one that closed it, as Qwen3's does with
`enable_thinking: false`: answering). With no tag in the prompt, DeepSeek-R1 thinks (its older template leaves
`<think>` to the model, and it may skip it); Qwen3 thinks unless `chat_template_kwargs.enable_thinking` is false.
An output that begins with `<think>` is thinking in either case (the tag is dropped). A thinking output without
`</think>` (cut short) is all reasoning.

`ReasoningStream` splits the text as it grows, holding back only what could be the start of a tag, so the pieces
a stream sends make the whole reply's fields exactly, however the text was cut."""
from __future__ import annotations

from dataclasses import dataclass

from eyas.serve.tools import _before_tag

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start_id: int
    end_id: int

    def thinking(self, prompt_ids: list[int], template_kwargs: dict | None = None) -> bool:
        """Whether the output starts in the thinking (the module's rule)."""
        for t in reversed(prompt_ids):
            if t == self.end_id:
                return False
            if t == self.start_id:
                return True
        if self.name == "qwen3":
            return (template_kwargs or {}).get("enable_thinking", True) is not False
        return True

    def stream(self, thinking: bool, inner=None, include: bool = True) -> "ReasoningStream":
        return ReasoningStream(thinking, inner, include)

    def reasoning_tokens(self, ids: list[int], thinking: bool) -> int:
        """How many of an output's tokens are its thinking (its tags included): those up to `</think>`, all of them
        if it never came; none for an output that answers from the start."""
        if not thinking and not (ids and ids[0] == self.start_id):
            return 0
        return ids.index(self.end_id) + 1 if self.end_id in ids else len(ids)


def make_reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """ValueError for an unknown name, a model without a tokenizer, or a tokenizer without the tags as tokens."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
    if tokenizer is None:
        raise ValueError(f"reasoning parser {name}: this model has no tokenizer")
    ids = [tokenizer.backend.token_to_id(t) for t in (START, END)]
    missing = [t for t, i in zip((START, END), ids) if i is None]
    if missing:
        raise ValueError(f"reasoning parser {name}: the tokenizer has no {' or '.join(missing)} token (not a "
                         "reasoning model's tokenizer?)")
    return ReasoningParser(name, ids[0], ids[1])


class ReasoningStream:
    """One choice's reply from its text as it grows: `feed(delta)` gives the chat deltas to send now
    (`{"reasoning", "reasoning_content"}` for thinking, and the answer's: `{"content"}`, or `inner`'s, a
    `eyas.serve.tools.ToolStream`, which reads tool calls from the answer), `finish(reason)` the last ones and the
    finish_reason, `message(text, reason)` the non-streaming reply. `include` false (vLLM's `include_reasoning`):
    the thinking is dropped."""

    def __init__(self, thinking: bool, inner=None, include: bool = True):
        self.thinking, self.inner, self.include = thinking, inner, include
        self.phase = "head"  # "head" (a leading <think> may come), "think", "answer"
        self.buf = ""

    def feed(self, delta: str) -> list[dict]:
        self.buf += delta
        reasoning, content = "", ""
        if self.phase == "head":
            lead = self.buf.lstrip()
            if START.startswith(lead):  # nothing but blanks and maybe the tag's beginning so far
                if lead != START:
                    return []
            if lead.startswith(START):
                self.buf, self.phase = lead[len(START):], "think"
            else:
                self.phase = "think" if self.thinking else "answer"
        if self.phase == "think":  # up to the end tag, or to where it may be starting
            cut = _before_tag(self.buf, END)
            reasoning = self.buf[:cut]
            if self.buf.startswith(END, cut):
                self.buf, self.phase = self.buf[cut + len(END):], "answer"
            else:
                self.buf = self.buf[cut:]
        if self.phase == "answer":
            content, self.buf = self.buf, ""
        return self._parts(reasoning, content)

    def _parts(self, reasoning: str, content: str) -> list[dict]:
        out = [{"reasoning": reasoning, "reasoning_content": reasoning}] if reasoning and self.include else []
        if content:
            out += self.inner.feed(content) if self.inner is not None else [{"content": content}]
        return out

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        rest, self.buf = self.buf, ""
        if self.phase == "head":  # blanks or a tag's beginning only
            self.phase = "think" if self.thinking else "answer"
        out = self._parts(rest, "") if self.phase == "think" else self._parts("", rest)
        if self.inner is None:
            return out, reason
        last, reason = self.inner.finish(reason)
        return out + last, reason

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        from eyas.serve.tools import merge_deltas
        deltas = self.feed(text)
        last, reason = self.finish(reason)
        return merge_deltas(deltas + last), reason
