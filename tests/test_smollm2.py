"""The embedded default model against HF transformers loading the same GGUF file."""
import random

import pytest
import torch

from conftest import mt_bench_first_turns
from eyas import SamplingParams
from eyas.loader.resolve import smollm2_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # transformers' GGUF converter gives every byte-level BPE GPT-2's pre-tokenizer and ignores `tokenizer.ggml.pre`
    # ("smollm"); SmolLM2's own tokenizer.json isolates digits first, as llama.cpp does for "smollm"
    from tokenizers import pre_tokenizers
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return tok, model


def test_greedy_equals_hf(smollm2, hf_pair):
    hf_tok, hf_model = hf_pair
    for question in mt_bench_first_turns(3):
        messages = [{"role": "user", "content": question}]
        hf_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(hf_ids, "keys"):
            hf_ids = hf_ids["input_ids"]
        ours = smollm2.chat(messages, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0]
        assert ours.prompt_token_ids == list(hf_ids)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([hf_ids]), max_new_tokens=32, do_sample=False,
                                    min_new_tokens=32)[0, len(hf_ids):].tolist()
        assert ours.token_ids == ref, question


def _strings():
    rng = random.Random(0)
    base = ["Hello, world!", "  leading spaces", "trailing   ", "tabs\tand\nnewlines\r\n", "naïve café", "日本語のテキスト",
            "emoji 🎉🚀", "numbers 1234567890 3.14159", "<|im_start|>user\nhi<|im_end|>", "code: def f(x): return x**2",
            "MiXeD CaSe", "don't won't it's",
            "Here are three:\n\n1. a\n\n2. b", "x  45\t\t6 \n 7", "", "a" * 300, "\u00a0nbsp", "http://example.com/a?b=c&d=e"]
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"()[]{}\n\t-_/\\@#$%^&*+=<>|~`éüß中文😀"
    for _ in range(300):
        base.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))))
    return base


def test_tokenizer_equals_hf(smollm2, hf_pair):
    hf_tok, _ = hf_pair
    ours = smollm2.tokenizer
    for s in _strings():
        ids = ours.encode(s)
        assert ids == hf_tok.encode(s, add_special_tokens=True), s
        assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), s
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages) == hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                           tokenize=False)


# MT-Bench first turns whose greedy answers start a list ("\n\n", "1", ".") within 64 tokens
LIST_PROMPTS = [8, 68, 69, 74, 76, 78]


def test_greedy_answers_retokenise_to_themselves(smollm2):
    """The model writes the tokenisation it was trained on, so its greedy answers, decoded and encoded again, give
    back the same tokens. A pre-tokenizer without SmolLM2's digit split fails here: "\n\n1." comes back as "\n",
    "\n", "1", "." (the reason distillation data that is stored as text must be read with the right tokenizer)."""
    qs = mt_bench_first_turns()
    tok = smollm2.tokenizer
    outs = smollm2.chat([[{"role": "user", "content": qs[i]}] for i in LIST_PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=64))
    for i, o in zip(LIST_PROMPTS, outs):
        ids = [t for t in o.token_ids if t != tok.eos_token_id]
        assert tok.encode(tok.decode(ids)) == ids, (i, tok.decode(ids))
