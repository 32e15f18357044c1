"""Per-request sampling settings, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GuidedDecoding:
    """What the output must match (guided decoding, `eyas.spec.grammar`); exactly one field is set.

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a regular expression the
    whole output matches; choice: one of these strings exactly; grammar: an EBNF grammar (xgrammar's dialect, GBNF-like,
    whose start rule is `root`); structural_tag: xgrammar's structural tag (vLLM's `response_format` of that type):
    either `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` (free text, where each trigger opens a
    structure whose content follows its JSON schema), or `{"format": {...}}` (xgrammar's format objects)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: dict | None = None
    # the grammar applies from after the output's first such token; any token before it (a reasoning model's
    # thinking, up to its `</think>`: what `eyas serve --reasoning-parser` sets)
    after_token_id: int | None = None

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError("guided decoding takes exactly one of json, json_object, regex, choice, grammar, "
                             "structural_tag; got "
                             f"{given or 'none'}")
        if self.after_token_id is not None and not _is_token_id(self.after_token_id):
            raise ValueError(f"guided after_token_id must be a token id (an integer >= 0), got {self.after_token_id!r}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"guided json must be a JSON schema (a dict or its text), got {type(self.json).__name__}")
        if self.json_object not in (True, False):
            raise ValueError(f"guided json_object must be true or false, got {self.json_object!r}")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"guided {k} must be a non-empty string, got {v!r}")
        st = self.structural_tag
        if st is not None and (not isinstance(st, dict) or ("structures" in st) == ("format" in st)):
            raise ValueError("guided structural_tag must be an object with either structures (and triggers) or "
                             f"format, got {st!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise ValueError(f"guided choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        kinds = ("json", "regex", "choice", "grammar", "structural_tag")
        return next(k for k in kinds if getattr(self, k) is not None) if not self.json_object else "json_object"


def _is_token_id(t) -> bool:
    """An integer >= 0 (not a bool): what a token id given in a request may be."""
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


MAX_LOGPROBS = 20  # the most alternatives a token's log-probabilities list (vLLM's default limit)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the likeliest (vLLM's; 0: off)
    max_tokens: int = 64
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: the text keeps the stop string that ended it
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens' text (e.g. "<|im_end|>") in the output
    truncate_prompt_tokens: int | None = None  # vLLM's: only the prompt's last k tokens are read (left truncation)
    # vLLM's: no stop token (end of sequence, stop_token_ids) before this many output tokens, and no stop string
    # ending before it (applied with the penalties: eyas.layers.penalties)
    min_tokens: int = 0
    guided: GuidedDecoding | None = None  # the output must match a schema, regex, choice or grammar
    # log-probabilities of each output token and of the `logprobs` likeliest tokens in its place (0: the output
    # token's only), under the target's logits before temperature, top-k and top-p (eyas.layers.logprobs)
    logprobs: int | None = None
    # the same for every prompt token after the first (vLLM's `prompt_logprobs`; OpenAI's completions with `echo`):
    # the target's log-probability of each prompt token given those before it, and the k likeliest in its place.
    # A request that asks for them takes nothing from the prefix cache (every prompt position must be computed)
    prompt_logprobs: int | None = None
    # repetition penalties, as vLLM's (eyas.layers.penalties): presence and frequency (OpenAI's, in [-2, 2]) on the
    # output's tokens, repetition (CTRL's, > 0; 1 is off) on the prompt's and the output's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to the target's logits (applied with the penalties)
    logit_bias: dict[int, float] | None = None
    # vLLM's: the output's tokens are drawn from these alone (every other token's logit -inf, with the penalties)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words and phrases the output never contains (eyas.layers.bad_words: tokenized with and without a leading
    # space; a sequence's last token is refused where the output's tokens before it are its others)
    bad_words: list[str] | None = None
    # the same as token sequences, banned as they are (HF's bad_words_ids; for models without a tokenizer too)
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's request priority (lower is served first) under the priority scheduling policy
    # (`EngineConfig.scheduling_policy`, eyas.engine.scheduler); a request setting that travels with the sampling ones
    priority: int = 0

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        self.min_p = float(self.min_p)
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {m!r}")
        if m and self.guided is not None:  # a grammar may have to end where the stop tokens are refused
            raise ValueError("min_tokens with guided decoding is not supported")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or None, got {k!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a boolean, got {self.skip_special_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        k = self.prompt_logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
            setattr(self, name, float(v))
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {r!r}")
        self.repetition_penalty = float(r)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
            bias = {}
            for t, b in self.logit_bias.items():
                if not _is_token_id(t):
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
                bias[t] = float(b)
            self.logit_bias = bias or None
        a = self.allowed_token_ids
        if a is not None:
            if not isinstance(a, (list, tuple)) or not a or not all(_is_token_id(t) for t in a):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), got {a!r}")
            self.allowed_token_ids = sorted(set(a))
            if self.guided is not None:  # the grammar may allow none of them
                raise ValueError("allowed_token_ids with guided decoding is not supported")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        from eyas.layers.bad_words import MAX_WORDS
        w = self.bad_words
        if w is not None:
            if not isinstance(w, (list, tuple)) or any(not isinstance(x, str) or not x.strip() for x in w):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {w!r}")
            self.bad_words = list(w) or None
        w = self.bad_words_token_ids
        if w is not None:
            if (not isinstance(w, (list, tuple)) or any(
                    not isinstance(x, (list, tuple)) or not x
                    or not all(_is_token_id(t) for t in x) for x in w)):
                raise ValueError(f"bad_words_token_ids must be a list of non-empty lists of token ids, got {w!r}")
            self.bad_words_token_ids = [list(x) for x in w] or None
        if len(self.bad_words or ()) + len(self.bad_words_token_ids or ()) > MAX_WORDS:
            raise ValueError(f"bad_words: at most {MAX_WORDS} words")
        if self.has_bad_words and self.guided is not None:  # the grammar may need a banned token
            raise ValueError("bad_words with guided decoding is not supported")
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise ValueError(f"guided must be a GuidedDecoding, got {type(self.guided).__name__}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.logit_bias is not None or self.min_tokens > 0 or self.allowed_token_ids is not None
                or self.has_bad_words)

    @property
    def has_bad_words(self) -> bool:
        return self.bad_words is not None or self.bad_words_token_ids is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
