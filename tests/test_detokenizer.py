"""Incremental detokenisation: after every committed chunk of tokens the text equals a whole decode of the output,
the streamed deltas concatenate to its final part, and the engine ends outputs (tokens, text, finish reason) with
stop strings exactly where decoding the whole output after every token did."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models

from eyas import LLM, SamplingParams
from eyas.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer, OutputText, decoding_of
from eyas.loader.tokenizer import Tokenizer, _bytes_to_unicode
from helpers import write_mirror_pair

SPELL = _bytes_to_unicode()


def _spell(b: bytes) -> str:
    return "".join(SPELL[x] for x in b)


def byte_level_tokenizer(pieces: list[bytes], specials: list[str]) -> Tokenizer:
    """A byte-level BPE tokenizer as eyas builds one from GGUF metadata: `pieces` (ids 0..), then `specials`."""
    tokens = [_spell(p) for p in pieces] + specials
    return Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                                         "tokenizer.ggml.tokens": tokens,
                                         "tokenizer.ggml.token_type": [1] * len(pieces) + [3] * len(specials)})


# parts of multi-byte characters (中, 🎉, —, é), a space, a newline, a lone continuation byte, two specials: 24 ids
TINY_PIECES = [b"a", b"b", b" ", b"ab", b" a", b"\n", b"\xe4", b"\xb8", b"\xad", b"\xe4\xb8", b"\xad ", b"\xf0\x9f",
               b"\x8e\x89", b"\xf0\x9f\x8e", b"\x89", b"c", b"cd", b"x", b"\xe2\x80", b"\x94", b"\xc3", b"\xa9"]
TINY_SPECIALS = ["<|end|>", "<|x|>"]


def sentencepiece_tokenizer(scheme: str) -> Tokenizer:
    """SentencePiece-style: "llama2" (Replace/ByteFallback/Fuse/Strip, byte tokens <0xXX>) or Metaspace."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["▁", "▁▁", "▁a", "b", "▁中", "文", "▁the", ".", "a▁"]
    backend = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                                     byte_fallback=True))
    if scheme == "llama2":
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
    else:
        backend.decoder = decoders.Metaspace(prepend_scheme=scheme)
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>")


def wordpiece_tokenizer(decoder) -> Tokenizer:
    words = ["[UNK]", "[SEP]", "the", "cat", "##s", ".", ",", "n't", "do", "not", "'", "m", "?", "'s", "##ing"]
    backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.decoder = decoder
    backend.add_special_tokens([AddedToken("[SEP]", special=True)])
    return Tokenizer(backend)


def smollm2():
    from conftest import smollm2_tokenizer
    return smollm2_tokenizer()


def smollm2_ids(tok: Tokenizer) -> list[int]:
    """Ids to draw from: the pieces of emoji, CJK, accented and plain text, the 256 single bytes, special tokens."""
    text = "Hello, 世界! 🎉😀👨‍👩‍👧 한국어 naïve café — “quotes” \n\t  x=1; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃️ Привет"
    ids = set(tok.encode(text)) | set(range(17))
    ids |= {tok.backend.token_to_id(c) for c in SPELL.values()} - {None}
    return sorted(ids)


TOKENIZERS = {  # name: (tokenizer, an id that decodes to plain text of its own)
    "smollm2": lambda: (smollm2(), "x"),
    "tiny_byte_level": lambda: (byte_level_tokenizer(TINY_PIECES, TINY_SPECIALS), "x"),
    "llama2": lambda: (sentencepiece_tokenizer("llama2"), "b"),
    "metaspace_always": lambda: (sentencepiece_tokenizer("always"), "b"),
    "metaspace_first": lambda: (sentencepiece_tokenizer("first"), "b"),
    "wordpiece": lambda: (wordpiece_tokenizer(decoders.WordPiece(cleanup=True)), "cat"),
    "no_decoder": lambda: (wordpiece_tokenizer(None), "cat"),
    "ctc": lambda: (wordpiece_tokenizer(decoders.CTC(pad_token="[UNK]")), "cat"),  # not allowed: whole decodes
}
_cache = {}


def tokenizer_and_ids(name):
    if name not in _cache:
        tok, plain = TOKENIZERS[name]()
        ids = smollm2_ids(tok) if name == "smollm2" else list(range(tok.vocab_size))
        _cache[name] = tok, ids, tok.backend.token_to_id(plain)
    return _cache[name]


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_incremental_text_equals_whole_decode(name, data):
    tok, pool, plain = tokenizer_and_ids(name)
    decoding = decoding_of(tok)
    incremental, hold = decoding.incremental, decoding.hold
    assert incremental is (name != "ctc") and decoding.context is (name not in ("smollm2", "tiny_byte_level"))
    prompt = data.draw(st.lists(st.sampled_from(pool), max_size=3))
    # chunks of 1..4 tokens, as speculative steps commit them
    chunks = data.draw(st.lists(st.lists(st.sampled_from(pool), min_size=1, max_size=4), max_size=40))
    skip = data.draw(st.booleans())  # SamplingParams.skip_special_tokens
    ids = list(prompt)
    detok = IncrementalDetokenizer(tok, len(ids), decoding, skip)
    deltas = []
    for chunk in chunks + [[plain]]:
        ids += chunk
        deltas.append(detok.update(ids))
        assert detok.text == tok.decode(ids[len(prompt):], skip_special_tokens=skip)
        assert "".join(deltas) == detok.stable and str(detok.snapshot()) == detok.text
        assert all(detok.tail(i) == detok.text[i:] for i in range(len(detok.text) + 1))
        if incremental:  # the text held back is text that may still change
            assert detok.pending == "" or detok.pending.endswith(REPLACEMENT) or ids[-1] in hold
    if incremental:  # after a plain token all the text is final
        assert detok.pending == "" and detok.stable == tok.decode(ids[len(prompt):], skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.text(max_size=4), max_size=8), pending=st.text(max_size=4), data=st.data())
def test_output_text_reads_as_the_joined_string(pieces, pending, data):
    """`OutputText` (an output's text as a step left it, read from the detokenizer's pieces) against the string it
    stands for: whole, from any start, cut anywhere, with pieces appended after it was taken."""
    whole = "".join(pieces) + pending
    cut = data.draw(st.integers(0, len(whole)))
    shared = list(pieces)
    view = OutputText(shared, len(pieces), len(whole) - len(pending), pending, cut)
    shared += ["later", "x"]  # later steps append to the detokenizer's list
    starts = range(len(whole) + 2)
    assert [view.since(i) for i in starts] == [whole[:cut][i:] for i in starts]
    assert str(view) == whole[:cut] and len(view) == cut
    assert [view.since(i) for i in starts] == [whole[:cut][i:] for i in starts]  # also once joined (cached)


def test_windows_stay_small_on_real_text():
    """On ordinary text the window holds a few recent tokens: the work per update does not grow."""
    tok = smollm2()
    text = "Speculative decoding 推测解码 🎉 — naïve café. " * 40
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, 0, decoding_of(tok))
    widest = 0
    for n in list(range(3, len(ids), 3)) + [len(ids)]:
        detok.update(ids[:n])
        widest = max(widest, n - detok.prefix)
    assert detok.text == text and widest <= 12


# ---- the engine: stop strings inside multi-token (speculative) commits ----------------------------------------
def _old_semantics(tok, out_ids, stops):
    """What the engine did before: decode the whole output after each token, cut at the first stop string."""
    for k in range(1, len(out_ids) + 1):
        text = tok.decode(out_ids[:k])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return out_ids[:k], text[:min(hits)], "stop"
    return out_ids, tok.decode(out_ids), "length"


@pytest.fixture(scope="module")
def pair_with_tokenizer(tmp_path_factory):
    target, draft = write_mirror_pair(tmp_path_factory.mktemp("detok"), vocab=24, layers=2)
    byte_level_tokenizer(TINY_PIECES, TINY_SPECIALS).backend.save(str(target / "tokenizer.json"))
    return target, draft


@pytest.mark.parametrize("spec", [None, "chain:4", "tree:mc_sim_7b_63"])
def test_engine_stop_strings_as_before(pair_with_tokenizer, spec):
    target, draft = pair_with_tokenizer
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft) if spec else None, speculation=spec)
    tok = llm.tokenizer
    assert llm.engine.decoding.incremental
    prompts = [[i, (5 * i + 3) % 22, (7 * i + 1) % 22] for i in range(8)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0 if i % 2 else 1.0, seed=i)
              for i in range(len(prompts))]
    ref = llm.generate(prompts, params)
    for o in ref:
        assert o.text == tok.decode(o.token_ids)
    if spec:
        assert sum(o.stats.committed for o in ref) > 1.5 * sum(o.stats.target_calls for o in ref)
    # stop strings taken from the texts of prefixes of the outputs (across multi-byte characters, or a last
    # character, which may be an incomplete one, U+FFFD), and two that may not occur
    def stops_for(ids, r):
        if r == 3:
            return ["\u4e2d", "\ufffd"] if ids[0] % 2 else ["never there"]
        k, start, length = ((9, 2, 3), (17, 5, 2), (30, -1, 1))[r]
        return [tok.decode(ids[:k])[start:][:length] or "a", "zz"]

    for r in range(4):
        stops = [stops_for(o.token_ids, r) for o in ref]
        sp = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=p.temperature, seed=p.seed, stop=s)
              for p, s in zip(params, stops)]
        engine = llm.engine
        seqs = [engine.add_request(p, s) for p, s in zip(prompts, sp)]
        finals, every = {}, {}
        while engine.has_unfinished():
            for out in engine.step():
                every.setdefault(out.request_id, []).append(out)
                if out.finished:
                    finals[out.request_id] = out
        # read once every request is done: each output still holds the totals of its own step (they are read
        # from the sequence's growing state when asked for), and its running text is a whole decode, as before
        for outs in every.values():
            ids = []
            for out in outs:
                ids += out.new_token_ids
                assert out.token_ids == ids and out.num_output_tokens == len(ids)
                text = out.text
                assert out.finished or text == tok.decode(ids)
                assert all(out.text_since(i) == text[i:] for i in range(0, len(text) + 2, 3))
        for seq, s, o in zip(seqs, stops, ref):
            want_ids, want_text, want_reason = _old_semantics(tok, o.token_ids, s)
            got = finals[seq.request_id]
            assert (got.token_ids, got.text, got.finish_reason) == (want_ids, want_text, want_reason), s
            assert seq.text == want_text


@pytest.mark.parametrize("spec", [None, "chain:4"])
def test_skip_special_tokens(pair_with_tokenizer, spec):
    """`SamplingParams.skip_special_tokens` (vLLM's; True by default): False keeps the special tokens' text in the
    output. A logit bias makes special tokens likely; each text equals the whole decode with the same setting."""
    target, draft = pair_with_tokenizer
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft) if spec else None, speculation=spec)
    tok = llm.tokenizer
    special = len(TINY_PIECES)  # "<|end|>"
    outs = {skip: llm.generate([[3, 4, 5], [1, 2]], SamplingParams(
        max_tokens=20, ignore_eos=True, logit_bias={special: 3.0}, skip_special_tokens=skip)) for skip in (True, False)}
    for skip, got in outs.items():
        for o in got:
            assert o.text == tok.decode(o.token_ids, skip_special_tokens=skip)
    assert any(special in o.token_ids for o in outs[False])
    assert all("<|end|>" in o.text for o in outs[False] if special in o.token_ids)
    assert not any("<|end|>" in o.text for o in outs[True])
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")


@pytest.mark.parametrize("spec", [None, "chain:4"])
def test_min_tokens_holds_off_stop_strings(pair_with_tokenizer, spec):
    """vLLM's `min_tokens` and stop strings: no stop string that ends before the min_tokens-th output token ends the
    output (the search starts at that token, steps that cross it searched token by token); one that ends after does,
    as without min_tokens. The tokens are those of the same request without stop strings (stops do not change them)."""
    target, draft = pair_with_tokenizer
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft) if spec else None, speculation=spec)
    tok = llm.tokenizer
    prompts = [[i, (5 * i + 3) % 22, (7 * i + 1) % 22] for i in range(8)]
    ref = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    m, held = 12, 0

    def char_of(ids):
        return next((c for c in tok.decode(ids) if c.isascii() and c.isalnum()), None)
    for p, r in zip(prompts, ref):
        # a stop string in the first tokens, and one in the (m-1)-th token (a step that crosses m meets it)
        for stop, before in ((char_of(r.token_ids[:3]), 3), (char_of(r.token_ids[m - 2: m - 1]), m - 1)):
            if stop is None:
                continue
            free = llm.generate([p], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
            got = llm.generate([p], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop], min_tokens=m))[0]
            assert free.finish_reason == "stop" and len(free.token_ids) <= before
            assert got.token_ids == r.token_ids[:len(got.token_ids)] and len(got.token_ids) >= m
            whole = tok.decode(got.token_ids)
            assert whole.startswith(got.text)
            if got.finish_reason == "stop":  # cut at a stop string that ends in a token at or past the m-th
                assert whole[len(got.text):].startswith(stop)
                assert len(got.text) + len(stop) > len(tok.decode(r.token_ids[:m - 1]))
            held += 1
    assert held >= 6


def test_stop_string_in_streamed_deltas(pair_with_tokenizer):
    """The server's streamed deltas concatenate to the final (stop-trimmed) text."""
    from eyas.engine.detokenizer import TextStream
    target, draft = pair_with_tokenizer
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="chain:4")
    ref = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    stop = llm.tokenizer.decode(ref.token_ids[:20])[-3:]
    engine = llm.engine
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))
    stream, sent, final = TextStream([stop]), [], None
    while engine.has_unfinished():
        for out in engine.step():
            sent.append(stream.delta(out))
            final = out
    assert final.finish_reason == "stop" and "".join(sent) == final.text and stop not in final.text


def test_generate_prints_the_final_text_only(pair_with_tokenizer, capsys):
    """`eyas generate` streams through `TextStream`: what it prints is the final text, never an incomplete
    character (U+FFFD) that a later token completes, on outputs that split multi-byte characters between steps."""
    from eyas.cli import main
    target, _ = pair_with_tokenizer
    llm = LLM(str(target), device="cpu", dtype="float32")
    split = 0
    for seed in range(3):
        args = ["generate", "--model", str(target), "--prompt", "ab", "--max-tokens", "40", "--temperature", "1",
                "--seed", str(seed), "--ignore-eos", "--device", "cpu", "--dtype", "float32", "--draft", "none"]
        assert main(args) == 0
        printed = capsys.readouterr().out
        ref = llm.generate("ab", SamplingParams(max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True))[0]
        tok = llm.tokenizer
        split += any(REPLACEMENT in tok.decode(ref.token_ids[:k]) for k in range(len(ref.token_ids)))
        assert printed.rstrip("\n") == ref.text.rstrip("\n")
    assert split  # some output's running text ended in an incomplete character on the way
