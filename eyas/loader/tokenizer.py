"""A thin tokenizer over `tokenizers`, with the model's chat template (rendered with jinja2 as HF does)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (byte-level BPE vocabularies are written in it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# llama.cpp's names (`tokenizer.ggml.pre`) for byte-level BPE pre-tokenizers, by what they split before the BPE:
# GPT-2's regex alone, or every digit on its own first (`\p{N}`, then GPT-2's regex; the HF tokenizer.json of these
# models has `Sequence[Digits(individual_digits=True), ByteLevel]`). SmolLM2 is "smollm": without the digit split,
# "\n\n1." would tokenise as "\n", "\n", "1", "." where the model was trained on (and writes) "\n\n", "1", ".".
_GPT2_PRE = {"gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"}
_UNNAMED_PRE = {None, "default"}  # files that name no pre-tokenizer: GPT-2's, as eyas read every GGUF before
_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe"}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PRE = {"qwen2"}
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2's: Llama 3's, digits one by one


def gguf_pre_tokenizer(pre: str | None):
    """The `tokenizers` pre-tokenizer for a GGUF's `tokenizer.ggml.pre` (byte-level BPE models)."""
    if pre in _UNNAMED_PRE:
        import warnings
        warnings.warn(f"this GGUF names no pre-tokenizer (tokenizer.ggml.pre = {pre!r}): splitting as GPT-2 does, "
                      "which may differ from the model's own tokenizer (llama.cpp warns likewise)", stacklevel=3)
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in _LLAMA3_PRE | _QWEN2_PRE:
        from tokenizers import Regex
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); eyas reads "
                     f"{sorted(_GPT2_PRE | _DIGITS_PRE | _LLAMA3_PRE | _QWEN2_PRE)}. Load the model's HF directory "
                     "(tokenizer.json) instead")


class Tokenizer:
    def __init__(self, backend: HFTokenizer, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos: bool = False):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos = add_bos
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """`text`'s ids, with the model's BOS first where it wants one (and `add_bos`)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            chat_template: str | None = None, **kwargs) -> str:
        """The conversation as the model reads it. `continue_final_message` (HF's and vLLM's): the text ends with
        the last message's content, left open (what the template would close it with is cut), so that the model
        goes on writing it: an assistant reply begun by the caller. It excludes `add_generation_prompt`. `tools`:
        OpenAI's tool definitions (`{"type": "function", "function": {...}}`), the template's `tools` variable as
        HF passes it (a template that does not read it ignores them). `chat_template`: a Jinja template to use in
        place of the model's; `kwargs`: more variables for the template (vLLM's `chat_template_kwargs`, e.g.
        `enable_thinking`), other than the ones this call sets."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template: use generate() with a plain prompt, or give one")
        taken = sorted(set(kwargs) & set(self.TEMPLATE_VARIABLES))
        if taken:
            raise ValueError(f"chat template variables {taken} are set by the call itself")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content', got {m!r}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        text = compile_template(template).render(
            **kwargs, messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        if continue_final_message:
            final = (messages[-1]["content"] if messages else "") or ""
            at = text.rfind(final.strip()) if final.strip() else -1
            if at < 0:
                raise ValueError("continue_final_message: the last message's content is empty or not in the "
                                 "rendered conversation")
            text = text[:at + len(final.strip())]
        return text

    # ---- builders -------------------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) from llama.cpp's metadata keys."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (eyas reads byte-level BPE, 'gpt2')")
        tokens = meta["tokenizer.ggml.tokens"]
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
                 for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                         end_of_word_suffix="", fuse_unk=False))
        backend.pre_tokenizer = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or []
        control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                   if ty == 3 and set(t) <= alphabet]
        if control:
            backend.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4]
        if user:
            backend.add_tokens(user)

        def tok(key):
            i = meta.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        return cls(backend, meta.get("tokenizer.chat_template"), tok("tokenizer.ggml.bos_token_id"),
                   tok("tokenizer.ggml.eos_token_id"), bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: Path) -> "Tokenizer | None":
        file = path / "tokenizer.json"
        if not file.exists():
            return None
        backend = HFTokenizer.from_file(str(file))
        cfg = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())

        def name(x):
            return x.get("content") if isinstance(x, dict) else x

        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        bos = name(cfg.get("bos_token"))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # HF's default: what the tokenizer's post-processor adds (Llama 3's TemplateProcessing)
            bos_id = backend.token_to_id(bos) if bos else None
            marked = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(marked) and marked[0] == bos_id
        return cls(backend, template, bos, name(cfg.get("eos_token")), bool(add_bos))


_templates: dict[str, jinja2.Template] = {}


def compile_template(source: str) -> jinja2.Template:
    if source not in _templates:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _templates[source] = env.from_string(source)
    return _templates[source]
