"""GGUF tokenizers split text before the BPE as llama.cpp does for the file's `tokenizer.ggml.pre`.

The expected pieces below follow llama.cpp's rules (llama-vocab.cpp): "gpt2" splits with GPT-2's regex alone;
"smollm" (and the other digit-splitting names) first isolates every digit (`\\p{N}`), which is what SmolLM2's own
tokenizer.json does (`Sequence[Digits(individual_digits=True), ByteLevel]`); "llama-bpe" uses Llama 3's regex, whose
numbers come in runs of at most three digits."""
import pytest

from eyas.loader.tokenizer import Tokenizer, _bytes_to_unicode

SPELL = _bytes_to_unicode()
PIECES = [b"\n", b"\n\n", b" ", b"  ", b"1", b"2", b"3", b"4", b"12", b"123", b".", b"a"]


def _spell(b: bytes) -> str:
    return "".join(SPELL[x] for x in b)


NL, SP = _spell(b"\n"), _spell(b" ")


def tokenizer(pre: str | None) -> Tokenizer:
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [_spell(p) for p in PIECES],
            "tokenizer.ggml.token_type": [1] * len(PIECES),
            "tokenizer.ggml.merges": [f"{NL} {NL}", f"{SP} {SP}", "1 2", "12 3"]}
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return Tokenizer.from_gguf_metadata(meta)


def pieces(tok: Tokenizer, text: str) -> list[bytes]:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    return [PIECES[i] for i in ids]


@pytest.mark.parametrize("pre", ["smollm", "starcoder"])
def test_digit_splitting_pre_tokenizer(pre):
    tok = tokenizer(pre)
    # whitespace before a digit stays one run, as SmolLM2 writes list items ("\n\n", "1", ".")
    assert pieces(tok, "a\n\n1.") == [b"a", b"\n\n", b"1", b"."]
    assert pieces(tok, "a  12") == [b"a", b"  ", b"1", b"2"]
    # digits never merge, even where the vocabulary has the merges
    assert pieces(tok, "1234") == [b"1", b"2", b"3", b"4"]


@pytest.mark.parametrize("pre", [None, "gpt-2", "default"])
def test_gpt2_pre_tokenizer(pre, recwarn):
    tok = tokenizer(pre)
    # a file that names no pre-tokenizer is read as before (GPT-2's), with a warning
    assert any("names no pre-tokenizer" in str(w.message) for w in recwarn) == (pre in (None, "default"))
    assert pieces(tok, "a\n\n1.") == [b"a", b"\n", b"\n", b"1", b"."]
    assert pieces(tok, "a  12") == [b"a", b" ", b" ", b"12"]
    assert pieces(tok, "1234") == [b"123", b"4"]


def test_llama3_pre_tokenizer():
    tok = tokenizer("llama-bpe")
    assert pieces(tok, "1234") == [b"123", b"4"]  # \p{N}{1,3}: "123", "4", each through the BPE
    assert pieces(tok, "12312") == [b"123", b"12"]
    assert pieces(tok, "a\n\n1.") == [b"a", b"\n\n", b"1", b"."]


def test_unknown_pre_tokenizer_is_an_error():
    with pytest.raises(ValueError, match="tokenizer.ggml.pre"):
        tokenizer("falcon")  # (qwen2's is read since session 55: tests/test_gguf.py)


def test_chat_prompts_hold_the_templates_bos_once(tmp_path):
    """A tokenizer that adds BOS (`add_bos_token`, Llama 2 and Mistral) and a template that writes it: a chat's
    prompt begins with one BOS (the template's; vLLM and HF tokenize a rendered template without special tokens),
    offline and through the server's /tokenize; a plain prompt still gets the tokenizer's BOS."""
    import json

    import httpx

    from eyas import LLM, SamplingParams
    from eyas.serve.api_server import create_app
    from helpers import SEP, tiny_tokenizer, write_tiny_chat_model
    from test_server import LiveServer
    tok = tiny_tokenizer()
    path = write_tiny_chat_model(tmp_path / "m", tok)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SEP, "eos_token": "<|end|>", "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"}))
    llm = LLM(str(path), device="cpu", dtype="float32")
    bos = llm.tokenizer.bos_token_id
    seen = []
    generate = llm.generate
    llm.generate = lambda prompts, *a, **k: (seen.extend(prompts), generate(prompts, *a, **k))[1]
    llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1))
    assert seen[0][0] == bos and seen[0].count(bos) == 1
    assert llm.tokenizer.encode("hi")[0] == bos  # a completion's prompt: the tokenizer's BOS
    del llm.generate
    server = LiveServer(create_app(llm, "m"))
    try:
        r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.json()["tokens"] == seen[0]
        # vLLM's add_special_tokens: the tokenizer's BOS too, in the chat endpoint's prompt and in /tokenize
        msgs = [{"role": "user", "content": "hi"}]
        r = httpx.post(server.url + "/tokenize", json={"messages": msgs, "add_special_tokens": True}, timeout=60)
        assert r.json()["tokens"] == [bos] + seen[0]
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 1,
                                                                  "add_special_tokens": True}, timeout=60)
        assert r.json()["usage"]["prompt_tokens"] == len(seen[0]) + 1
    finally:
        server.close()


def test_bos_follows_the_post_processor_where_the_config_is_silent(tmp_path):
    """No `add_bos_token` in tokenizer_config.json (Llama 3's): BOS where the tokenizer's post-processor adds it
    (HF's default for a plain prompt), none where it adds nothing."""
    import json

    from tokenizers import processors

    from helpers import SEP, tiny_tokenizer
    for post in (True, False):
        tok = tiny_tokenizer()
        if post:
            sep = (SEP, tok.backend.token_to_id(SEP))
            tok.backend.post_processor = processors.TemplateProcessing(single=f"{SEP} $A", special_tokens=[sep])
        d = tmp_path / str(post)
        d.mkdir()
        tok.backend.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": SEP, "eos_token": "<|end|>"}))
        t = Tokenizer.from_hf_dir(d)
        assert (t.encode("hi")[0] == t.bos_token_id) == post and t.encode("hi", add_bos=False)[0] != t.bos_token_id
