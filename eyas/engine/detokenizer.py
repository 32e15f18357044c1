"""Incremental detokenisation: a sequence's output text kept up to date in O(new tokens) per step.

Decoding the whole output again at every step costs O(n) per step, O(n^2) per request, and dominated the host
time of long generations. As vLLM does (`detokenize_incrementally`), we decode only a window of recent tokens
ids[prefix:] and take the text it adds after its first tokens ids[prefix:read], the context that keeps right what
depends on the tokens before (decoders that drop the first token's leading space). The window moves on once its
text is final: it does not end in U+FFFD (an incomplete UTF-8 character, which later bytes may complete) nor in a
token in `Decoding.hold` (byte-fallback tokens such as `<0xE4>`, which the decoder joins with the byte tokens after
them).

Prefix-stability: this needs decode(ids[:r]) to be final once it ends in a complete character, so that decode(ids)
== decode(ids[:r]) + (what the window adds). `decoding_of` allows the decoders for which this holds: byte-level BPE
(Llama 3, SmolLM2, GGUF "gpt2" tokenizers: the tokens' bytes joined, no context needed), SentencePiece-style ones
(Metaspace, or Replace/ByteFallback/Fuse/Strip as Llama 2 writes them), WordPiece, and none. Their other steps (a
leading space dropped on, or added after, the first token; WordPiece's clean-up of " ." and the like, which
`tokenizers` applies token by token) see the same tokens in the window as in the whole output. Any other decoder
gets a whole decode per update: the old cost, the same text. tests/test_detokenizer.py checks each allowed kind
against whole decodes, on random ids.
"""
from __future__ import annotations

import json
import logging
import re
from typing import NamedTuple

log = logging.getLogger("eyas")
REPLACEMENT = "\ufffd"
# decoder types (`tokenizers.decoders`) whose output is prefix-stable in the sense above
_STABLE = {"ByteLevel", "Metaspace", "WordPiece", "Replace", "ByteFallback", "Fuse", "Strip"}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Decoding(NamedTuple):
    """How a tokenizer's output may be decoded a window at a time."""
    incremental: bool  # prefix-stable: decode a window of recent tokens (else the whole output, every update)
    hold: frozenset[int] = frozenset()  # ids after which the text is not final yet
    context: bool = True  # keep the last final tokens as the window's context (all but pure byte-level decoders)


WHOLE = Decoding(False)


def decoding_of(tokenizer) -> Decoding:
    """What the tokenizer's decoder allows. `hold`, for byte-fallback decoders: the byte tokens `<0xXX>`, whose
    bytes the decoder decodes together with the byte tokens after them (a run that is not valid UTF-8 as a whole
    becomes one U+FFFD per byte, also where a prefix of it was), and the added tokens, which decoding skips or which
    may sit inside such a run. `context`: a byte-level decoder only joins the tokens' bytes, so text that ends
    in a whole character is followed by the decode of the tokens after it, with no context."""
    decoder = tokenizer.backend.decoder
    if decoder is None:
        return Decoding(True)
    spec = json.loads(decoder.__getstate__())
    parts = spec["decoders"] if spec["type"] == "Sequence" else [spec]
    if not all(d["type"] in _STABLE and not (d["type"] == "Strip" and d.get("stop", 0)) for d in parts):
        return WHOLE
    hold = frozenset()
    if any(d["type"] == "ByteFallback" for d in parts):
        backend = tokenizer.backend
        hold = frozenset([i for t, i in backend.get_vocab(with_added_tokens=False).items() if _BYTE_TOKEN.fullmatch(t)]
                         + list(backend.get_added_tokens_decoder()))
    return Decoding(True, hold, context=[d["type"] for d in parts] != ["ByteLevel"])


class OutputText:
    """An output's text as one step left it, joined only when read. It holds the detokenizer's final pieces (a list
    that later steps only append to, shared), how many of them were final then, the pending text of that step, and
    the length kept (a stop string cuts it). Building one costs O(1); `str()` costs O(length) once (cached), and
    `since(i)`, the text from character i on, costs O(length - i + one piece), which is what a stream needs at
    every step."""

    __slots__ = ("_pieces", "_count", "_stable_len", "_pending", "_len", "_str")

    def __init__(self, pieces: list[str], count: int, stable_len: int, pending: str, length: int):
        self._pieces, self._count, self._stable_len, self._pending = pieces, count, stable_len, pending
        self._len = length
        self._str = None

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        if self._str is None:
            self._str = ("".join(self._pieces[:self._count]) + self._pending)[:self._len]
        return self._str

    def __repr__(self) -> str:
        return repr(str(self))

    def parts(self) -> tuple[list[str], int, int, str, int]:
        """(pieces, count, stable_len, pending, length), as `__init__` takes them: the text is pieces[:count]
        joined (`stable_len` characters) then `pending`, cut to `length`. The pieces list is shared, not copied."""
        return self._pieces, self._count, self._stable_len, self._pending, self._len

    def since(self, start: int) -> str:
        """The text from character `start` on (`str(self)[start:]`), reading only the pieces it needs."""
        if self._str is not None:
            return self._str[start:]
        return _text_since(self._pieces, self._count, self._stable_len, self._pending, self._len, start)


def _text_since(pieces: list[str], count: int, stable_len: int, pending: str, length: int, start: int) -> str:
    """(pieces[:count] joined + pending)[start:length], where the pieces joined are `stable_len` long."""
    if start >= length:
        return ""
    if start >= stable_len:
        return pending[start - stable_len:length - stable_len]
    pos, i = stable_len, count  # pos: where pieces[i] begins
    while pos > start:
        i -= 1
        pos -= len(pieces[i])
    return ("".join(pieces[i:count]) + pending)[start - pos:length - pos]


NO_TEXT = OutputText([], 0, 0, "", 0)


class IncrementalDetokenizer:
    """The text of ids[start:] for one growing list of token ids (a sequence's `token_ids`; `start`: where its
    output begins), as `tokenizer.decode` gives it (special tokens skipped unless `skip_special` is False).

    `text` (== tokenizer.decode(ids[start:]) after every `update`) is `stable`, the text of ids[start:read],
    which no later token can change, followed by `pending`, what the tokens since `read` decode to now. `stable`
    is kept as its pieces (one per update that made text final), so that a step never copies the whole text:
    `snapshot` and `tail` read what they need."""

    __slots__ = ("tokenizer", "decoding", "start", "prefix", "read", "prefix_text", "pieces", "stable_len",
                 "pending", "skip_special")

    def __init__(self, tokenizer, start: int, decoding: Decoding, skip_special: bool = True):
        self.tokenizer, self.decoding = tokenizer, decoding
        self.skip_special = skip_special  # False: special tokens' text kept (`SamplingParams.skip_special_tokens`)
        self.start = self.prefix = self.read = start
        self.prefix_text = ""  # decode(ids[prefix:read])
        self.pieces: list[str] = []  # the final text in pieces; only appended to (and cut back by `restore`)
        self.stable_len = 0
        self.pending = ""

    @property
    def stable(self) -> str:
        return "".join(self.pieces)

    @property
    def text(self) -> str:
        return self.stable + self.pending

    def tail(self, start: int) -> str:
        """`text[start:]`, reading only the pieces it needs."""
        return _text_since(self.pieces, len(self.pieces), self.stable_len, self.pending,
                           self.stable_len + len(self.pending), start)

    def snapshot(self, cut: int = -1) -> OutputText:
        """The text as it is now, cut at character `cut` when that is >= 0 (a stop string begins there)."""
        length = self.stable_len + len(self.pending)
        return OutputText(self.pieces, len(self.pieces), self.stable_len, self.pending,
                          length if cut < 0 else min(cut, length))

    def save(self) -> tuple:
        """The state, for `restore`: to decode the same new tokens again, one at a time."""
        return self.prefix, self.read, self.prefix_text, len(self.pieces), self.stable_len, self.pending

    def restore(self, state: tuple) -> None:
        self.prefix, self.read, self.prefix_text, count, self.stable_len, self.pending = state
        del self.pieces[count:]  # pieces added since `save`: no snapshot taken before it reaches them

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def update(self, ids: list[int]) -> str:
        """Take the ids so far (those of the last call plus any new ones); returns the text that became final
        (the streaming delta: the deltas concatenate to `stable`)."""
        if not self.decoding.incremental:
            self.pending = self._decode(ids[self.start:])
            return ""
        n = len(ids)
        window = self._decode(ids[self.prefix:n])
        self.pending = window[len(self.prefix_text):]
        if not self.pending or self.pending[-1] == REPLACEMENT or ids[n - 1] in self.decoding.hold:
            return ""  # nothing new, or not final yet: keep the window (an empty one would lose its context)
        delta = self.pending
        self.pieces.append(delta)
        self.stable_len += len(delta)
        self.pending = ""
        if self.decoding.context:
            self.prefix, self.read = self.read, n
            self.prefix_text = self._decode(ids[self.prefix:n])
        else:
            self.prefix = self.read = n
        return delta


class TextStream:
    """Streaming deltas of one output's text (the server's streamed choices, `eyas generate`'s printing). The
    engine gives the text so far (stop strings trimmed); we hold back a possible stop-string prefix (longest stop - 1
    characters) and an incomplete UTF-8 tail (U+FFFD), so that what was sent is always a prefix of the final text.
    Each step reads only the text not sent yet (`RequestOutput.text_since`) and the last characters sent, to check
    that they did not change."""

    CHECK = 8  # how many of the last characters sent are compared with the text again

    def __init__(self, stops: list[str]):
        self.sent_len = 0
        self.sent_tail = ""  # the last CHECK characters sent
        self.hold = max((len(s) for s in stops), default=1) - 1

    def delta(self, out) -> str:
        """The text to send for `out` (a `RequestOutput`), possibly ""."""
        back = len(self.sent_tail)
        seen = out.text_since(self.sent_len - back)
        new = seen[back:]
        upto = len(new)
        if not out.finished:
            while upto > 0 and new[upto - 1] == REPLACEMENT:  # the incomplete tail first, then a stop's prefix
                upto -= 1
            upto -= self.hold
        if upto <= 0:
            return ""
        if seen[:back] != self.sent_tail:  # cannot happen with byte-level BPE; never resend
            log.warning("streamed text is not a prefix of the final text")
        new = new[:upto]
        self.sent_len += upto
        self.sent_tail = (self.sent_tail + new)[-self.CHECK:]
        return new
