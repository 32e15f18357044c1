"""The OpenAI-compatible server (issue 6), against REAL servers: uvicorn on a free loopback port in a background thread.

* `spec` (slow): SmolLM2 with a random EAGLE draft and tree speculation; its offline reference outputs are computed
  with `LLM.chat` / `LLM.generate` on the same `LLM` before the server takes it over. A random draft is rarely
  accepted, but greedy (and seeded) output must not depend on speculation, batching or the transport.
* `tiny`: a random tiny Llama without a tokenizer (token-id prompts), for admission control, engine failures and the
  command line; its engine is throttled so that "a request still running" is not a race.
Every request loop is bounded in count and time.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from prometheus_client.parser import text_string_to_metric_families

from eyas import LLM, SamplingParams
from eyas.loader.resolve import resolve_draft_arg as _resolve_draft
from eyas.engine.detokenizer import TextStream
from eyas.serve.api_server import add_serve_parser, create_app, run_serve
from helpers import LiveServer, live_children, start_serve, write_tiny_llama

MODEL = "smollm2"
TREE_PATHS = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
MAX_MODEL_LEN = 1024

# ---- a live server -----------------------------------------------------------------------------------------------


# ---- the speculative SmolLM2 server and its offline references -----------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour of the sky."}],
]
COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
BAD_WORDS = ["Paris", "the capital"]  # the first is the greedy completion's first word
BEGUN = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour I name is"}]
PROMPTS = [
    "Hello, my name is",
    "Once upon a time, in a land far away, there lived a",
    "List three fruits:",
    "The quick brown fox",
    "Explain in one sentence why the sky is blue. The sky is blue because",
    "1, 2, 3, 4,",
    "Write a haiku about the sea:\n",
    "In 1969, the first humans",
]


def concurrent_cases() -> list[dict]:
    """32 clients: chat or completion, 8 prompts of different lengths, 4..16 tokens, greedy or seeded sampling,
    some with a stop string."""
    cases = []
    for i in range(32):
        c = dict(chat=i % 2 == 1, prompt=PROMPTS[i % 8], max_tokens=4 + (i * 5) % 13,
                 temperature=0.0 if i % 3 == 0 else 0.8, seed=1000 + i, stop=["\n"] if i % 4 == 2 else None)
        cases.append(c)
    return cases


N_SEED, N_CHOICES = 77, 3


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The server shares this process with its clients (event loop, client threads): on 2 cores, two OpenMP
    threads in the engine spin against them and every small matmul gets slow. One thread is much faster here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


ECHO_PROMPT = "The capital of France is Paris"


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    # SmolLM2's shipped draft: it accepts (a random one would not), so the server's commits span several tokens,
    # and its steps are cheaper on the CPU than a random draft's many one-token commits
    tmp = tmp_path_factory.mktemp("spec")
    tree = tmp / "tree.json"  # a small branching tree (depth 3, 5 nodes): cheap enough for the CPU
    tree.write_text(json.dumps(TREE_PATHS))
    # overlapped decoding on, as on a GPU with CUDA graphs: the server's admissions, stop strings and aborts
    # meet steps enqueued before the last was read back
    llm = LLM(MODEL, device="cpu", dtype="float32", draft="default", speculation=str(tree),
              max_num_seqs=64, num_blocks=512, max_model_len=MAX_MODEL_LEN, overlap=True)
    assert llm.draft is not None and llm.engine.tree.max_depth == 3

    # offline references, with speculation on, before the server takes the LLM over: one batch (one prefill, one
    # decode loop) of every request the tests below send
    greedy = SamplingParams(max_tokens=16)
    tok = llm.tokenizer
    cases = concurrent_cases()
    batch = {  # name: (prompts (ids or text), params)
        "chat": ([llm.chat_prompt_ids(c) for c in CONVERSATIONS], greedy),
        "completion": (COMPLETION_PROMPTS, greedy),
        "concurrent": ([tok.encode(tok.apply_chat_template([{"role": "user", "content": c["prompt"]}])) if c["chat"]
                        else c["prompt"] for c in cases],
                       [SamplingParams(max_tokens=c["max_tokens"], temperature=c["temperature"], seed=c["seed"],
                                       stop=c["stop"]) for c in cases]),
        "logprobs": ([llm.chat_prompt_ids(CONVERSATIONS[0])], SamplingParams(max_tokens=16, logprobs=3)),
        "echo": ([ECHO_PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1)),
        "bad_words": (COMPLETION_PROMPTS[:1], SamplingParams(max_tokens=16, bad_words=BAD_WORDS)),
        "continue": ([llm.chat_prompt_ids(BEGUN, continue_final_message=True)],
                     SamplingParams(max_tokens=8, temperature=0)),
        "n": ([PROMPTS[0]] * N_CHOICES, [SamplingParams(max_tokens=10, temperature=0.9, seed=N_SEED + j)
                                         for j in range(N_CHOICES)]),
    }
    prompts, params, spans = [], [], {}
    for name, (ps, p) in batch.items():
        spans[name] = (len(prompts), len(prompts) + len(ps))
        prompts += ps
        params += p if isinstance(p, list) else [p] * len(ps)
    outs = llm.generate(prompts, params)
    refs = {name: outs[a:b] for name, (a, b) in spans.items()}
    for one in ("logprobs", "echo", "bad_words", "continue"):
        refs[one] = refs[one][0]
    assert llm.engine.blocks.num_used == 0

    successors = []  # overlapped steps the server's engine enqueued (the tests below check it did)
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda seqs, after=None: (successors.append(after is not None), launch(seqs, after))[1]
    server = LiveServer(create_app(llm, MODEL, max_queue=64))
    server.refs = refs
    server.successors = successors
    yield server
    server.close()


# ---- acceptance 1: the openai client gets the offline text ---------------------------------------------------------

@pytest.mark.slow
def test_openai_client_chat_and_completions_match_offline(spec):
    client = spec.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    for conv, ref in zip(CONVERSATIONS, spec.refs["chat"]):
        r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=16, temperature=0)
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

        chunks = list(client.chat.completions.create(model=MODEL, messages=conv, max_tokens=16, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
            == [ref.finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
        assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
        assert all(c.usage is None for c in chunks[:-1])

    for prompt, ref in zip(COMPLETION_PROMPTS, spec.refs["completion"]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        # without include_usage there is no usage chunk
        assert all(c.usage is None for c in chunks)


@pytest.mark.slow
def test_n_choices_with_derived_seeds(spec):
    """n samples; choice j of a request with seed s samples as an offline request with seed s + j."""
    refs = spec.refs["n"]
    assert len({r.text for r in refs}) > 1  # the seeds do differ
    r = spec.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0.9,
                                         seed=N_SEED, n=N_CHOICES)
    assert [c.index for c in r.choices] == list(range(N_CHOICES))
    assert [c.text for c in r.choices] == [x.text for x in refs]
    assert r.usage.prompt_tokens == len(refs[0].prompt_token_ids)  # the prompt counts once
    assert r.usage.completion_tokens == sum(len(x.token_ids) for x in refs)
    chunks = list(spec.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0.9,
                                                   seed=N_SEED, n=N_CHOICES, stream=True))
    texts = [""] * N_CHOICES
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [x.text for x in refs]


# ---- acceptance 2: 32 concurrent streaming clients ----------------------------------------------------------------

@pytest.mark.slow
def test_32_concurrent_streaming_clients_match_offline(spec):
    cases, refs = concurrent_cases(), spec.refs["concurrent"]

    async def one(client, c):
        kw = dict(model=MODEL, max_tokens=c["max_tokens"], temperature=c["temperature"], seed=c["seed"],
                  stop=c["stop"], stream=True, stream_options={"include_usage": True})
        if c["chat"]:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": c["prompt"]}], **kw)
        else:
            stream = await client.completions.create(prompt=c["prompt"], **kw)
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                text += (ch.delta.content or "") if c["chat"] else ch.text
                finish = ch.finish_reason or finish
        return text, finish, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=spec.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, c) for c in cases)), timeout=400)

    before = spec.wait_idle()
    n0 = len(spec.successors)
    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    mismatches = [(i, got[0], ref.text) for i, (got, ref) in enumerate(zip(results, refs)) if got[0] != ref.text]
    assert not mismatches, mismatches
    for (text, finish, usage), ref in zip(results, refs):
        assert finish == ref.finish_reason
        assert usage.completion_tokens == len(ref.token_ids)
        assert usage.prompt_tokens == len(ref.prompt_token_ids)
    m = spec.wait_idle()
    assert m["eyas:kv_cache_used_blocks{}"] == 0 and m["eyas:kv_cache_usage_perc{}"] == 0
    # they were batched together: far fewer decode steps than tokens
    steps = m["eyas:engine_steps_total{kind=decode}"] - before["eyas:engine_steps_total{kind=decode}"]
    tokens = m["eyas:generation_tokens_total{}"] - before["eyas:generation_tokens_total{}"]
    assert tokens == sum(len(r.token_ids) for r in refs) and steps < tokens / 4, (steps, tokens)
    assert spec.engine.blocks.num_used == 0 and not spec.engine.has_unfinished()
    assert any(spec.successors[n0:])  # steps were overlapped while the streams ran
    print(f"32 concurrent streams: {elapsed:.1f} s")


# ---- acceptance 3: disconnects free their blocks -------------------------------------------------------------------

@pytest.mark.slow
def test_disconnected_clients_free_their_blocks(spec):
    before = spec.wait_idle()
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with spec.streams_left_midway(body, 3):
        during = spec.metrics()
        assert during["eyas:kv_cache_used_blocks{}"] > 0
        assert during["eyas:num_requests_running{}"] == 3
    after = spec.wait_idle(timeout=30)
    assert after["eyas:kv_cache_used_blocks{}"] == 0
    aborted = "eyas:request_success_total{finish_reason=abort}"
    assert after[aborted] - before[aborted] == 3
    assert spec.engine.blocks.num_used == 0

    # a non-streaming client that gives up (its read times out) is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(spec.url + "/v1/completions", json={**body, "stream": False}, timeout=2.0)
    after2 = spec.wait_idle(timeout=30)
    assert after2[aborted] - after[aborted] == 1
    # and the server goes on serving
    r = spec.client().completions.create(model=MODEL, prompt=COMPLETION_PROMPTS[0], max_tokens=16, temperature=0)
    assert r.choices[0].text == spec.refs["completion"][0].text


# ---- acceptance 4: bad input -----------------------------------------------------------------------------------------

def _bad_requests():
    chat = "/v1/chat/completions"
    cmpl = "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    return [
        # (path, body (str: raw), status, words in the message, param)
        (chat, '{"model": "smollm2", "messages": [', 400, "JSON", None),
        (cmpl, "not json at all", 400, "JSON", None),
        (cmpl, "[1, 2, 3]", 422, "object", None),
        (chat, {"model": MODEL}, 422, "messages", "messages"),
        (chat, {"model": MODEL, "messages": "hi"}, 422, "messages", "messages"),
        (chat, {"model": MODEL, "messages": msgs, "temperature": "hot"}, 422, "temperature", "temperature"),
        (cmpl, {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 422, "max_tokens", "max_tokens"),
        (cmpl, {"model": MODEL, "prompt": "hi", "stream": "yes"}, 422, "stream", "stream"),
        (cmpl, {"model": MODEL, "prompt": {"text": "hi"}}, 422, "prompt", "prompt"),
        (cmpl, {"model": MODEL, "prompt": "hi", "max_tokens": True}, 422, "max_tokens", "max_tokens"),
        (cmpl, {"model": MODEL, "prompt": "hi", "n": 2.5}, 422, "n", "n"),
        (chat, '{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', 422,
         "temperature", "temperature"),
        (chat, {"model": MODEL, "messages": [{"content": "hi"}]}, 422, "role", "messages"),
        (chat, {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]}, 400, "context length",
         "messages"),
        (cmpl, {"model": MODEL, "prompt": long_prompt}, 400, "context length", "prompt"),
        (cmpl, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        (chat, {"model": MODEL, "messages": msgs, "max_tokens": -3}, 400, "max_tokens", "max_tokens"),
        (chat, {"model": MODEL, "messages": msgs, "max_tokens": MAX_MODEL_LEN}, 400, "context length",
         "max_tokens"),
        (cmpl, {"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 6, "stream": True}, 400, "context length",
         "max_tokens"),
        (chat, {"model": MODEL, "messages": msgs, "temperature": -0.5}, 400, "temperature", "temperature"),
        (cmpl, {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p", "top_p"),
        (cmpl, {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n must be", "n"),
        (cmpl, {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop", "stop"),
        (cmpl, {"model": MODEL, "prompt": ""}, 400, "empty", "prompt"),
        (cmpl, {"model": MODEL, "prompt": [10 ** 9]}, 400, "token ids", "prompt"),
        (chat, {"model": "gpt-4o", "messages": msgs}, 404, "does not exist", "model"),
        (cmpl, {"model": "gpt-4o", "prompt": "hi", "stream": True}, 404, "does not exist", "model"),
    ]


@pytest.mark.slow
def test_bad_inputs_get_openai_errors_and_the_server_goes_on(spec):
    failures = []
    with httpx.Client(base_url=spec.url, timeout=60) as http:
        for path, body, status, words, param in _bad_requests():
            if isinstance(body, str):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(path, json=body)
            try:
                err = r.json()["error"]
                assert r.status_code == status
                assert set(err) == {"message", "type", "param", "code"}
                assert words.lower() in err["message"].lower()
                assert err["param"] == param
                assert err["type"] == "invalid_request_error"
            except (AssertionError, KeyError, ValueError) as e:
                failures.append((path, str(body)[:80], r.status_code, r.text[:300], repr(e)))
        assert not failures, "\n".join(map(str, failures))
        assert http.get("/nope").json()["error"]["message"]
        # a JSON body without a JSON Content-Type (curl -d) is still read as JSON
        r = http.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert http.get("/health").json() == {"status": "ok"}

    # the official client sees the same errors as its exception classes
    client = spec.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL, prompt="hi", extra_body={"top_p": "all"})
    # then a normal request is served normally, with nothing left behind
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATIONS[0], max_tokens=16, temperature=0)
    assert r.choices[0].message.content == spec.refs["chat"][0].text
    assert spec.wait_idle()["eyas:kv_cache_used_blocks{}"] == 0


# ---- acceptance 5: /metrics -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_metrics_parse_and_move(spec):
    r = httpx.get(spec.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name, kind in [("eyas:time_to_first_token_seconds", "histogram"),
                       ("eyas:time_per_output_token_seconds", "histogram"),
                       ("eyas:e2e_request_latency_seconds", "histogram"),
                       ("eyas:prompt_tokens", "counter"), ("eyas:generation_tokens", "counter"),
                       ("eyas:num_requests_running", "gauge"), ("eyas:num_requests_waiting", "gauge"),
                       ("eyas:kv_cache_usage_perc", "gauge"), ("eyas:spec_tokens_per_call", "gauge"),
                       ("eyas:spec_accepted_tokens_by_depth", "counter"), ("eyas:spec_verify_steps", "counter"),
                       ("eyas:spec_draft_forwards", "counter"), ("eyas:request_tokens_per_call", "histogram"),
                       ("eyas:spec_decode_steps_by_tree", "counter")]:
        assert name in families and families[name].type == kind, name
    depth = spec.engine.tree.max_depth
    assert {s.labels["depth"] for s in families["eyas:spec_accepted_tokens_by_depth"].samples
            if s.name.endswith("_total")} == {str(d) for d in range(1, depth + 1)}

    before = spec.wait_idle()
    ref = spec.refs["chat"][0]
    out = spec.client().chat.completions.create(model=MODEL, messages=CONVERSATIONS[0], max_tokens=16, temperature=0)
    assert out.choices[0].message.content == ref.text
    after = spec.wait_idle()

    def moved(key):
        return after[key] - before[key]

    n_out = len(ref.token_ids)
    assert moved("eyas:prompt_tokens_total{}") == len(ref.prompt_token_ids)
    # the offline reference ran the same prompt on this engine: its blocks were cached, and the counts below are
    # the reference's all the same
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert moved("eyas:prefix_cache_hits_total{}") == cached > 0
    assert moved("eyas:prefix_cache_queries_total{}") == len(ref.prompt_token_ids)
    assert moved("eyas:generation_tokens_total{}") == n_out
    assert moved("eyas:time_to_first_token_seconds_count{}") == 1
    assert moved("eyas:e2e_request_latency_seconds_count{}") == 1
    assert moved("eyas:time_per_output_token_seconds_count{}") == n_out - 1
    assert moved("eyas:e2e_request_latency_seconds_sum{}") > 0
    assert moved(f"eyas:request_success_total{{finish_reason={ref.finish_reason}}}") == 1
    assert moved("eyas:engine_steps_total{kind=prefill}") >= 1
    verify = moved("eyas:spec_verify_steps_total{}")
    assert verify >= 1 and moved("eyas:engine_steps_total{kind=decode}") == verify
    assert moved("eyas:spec_draft_forwards_total{}") == verify * depth
    assert moved(f"eyas:spec_decode_steps_by_tree_total{{tree={spec.engine.runner.tree_for(1).name}}}") == verify
    assert moved("eyas:spec_target_calls_total{}") == ref.stats.target_calls
    assert moved("eyas:spec_committed_tokens_total{}") == ref.stats.committed
    for d in range(depth):
        assert moved(f"eyas:spec_accepted_tokens_by_depth_total{{depth={d + 1}}}") == ref.stats.accepted_by_depth[d]
    assert after["eyas:spec_tokens_per_call{}"] >= 1.0
    assert after["eyas:spec_tree_depth{}"] == depth
    assert after["eyas:kv_cache_total_blocks{}"] == spec.engine.blocks.num_usable


def test_include_stop_str_in_output(spec):
    """vLLM's `include_stop_str_in_output` (through the openai client's extra_body): the completion ends where the
    stop string does, the string kept; without it, before the string (the offline greedy reference's text)."""
    ref = spec.refs["completion"][0].text
    word = ref.strip().split(" ")[1]
    end = ref.index(word)
    client = spec.client()
    for include, want in ((True, ref[: end + len(word)]), (False, ref[:end])):
        out = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS[0], max_tokens=16, temperature=0,
                                        stop=[word], extra_body={"include_stop_str_in_output": include})
        assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")


def test_bad_words_through_the_openai_client(spec):
    """vLLM's `bad_words` (extra_body): the completion equals offline `LLM.generate` with the same words (greedy,
    speculative), differs from the free one, and holds none of the words' token sequences; a word of more tokens
    than a bad word may have, or a blank one, is a 400; a value that is not a list of strings a 422."""
    from eyas.layers.bad_words import MAX_WORD_TOKENS, word_token_ids
    tok = spec.engine.tokenizer
    ref = spec.refs["bad_words"]
    client = spec.client()
    out = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS[0], max_tokens=16, temperature=0,
                                    extra_body={"bad_words": BAD_WORDS})
    assert out.choices[0].text == ref.text != spec.refs["completion"][0].text
    seqs = word_token_ids(BAD_WORDS, lambda t: tok.encode(t, add_bos=False))
    assert len(seqs) == 4 and any(len(w) > 1 for w in seqs)
    ids = ref.token_ids
    assert not any(ids[i: i + len(w)] == w for w in seqs for i in range(len(ids)))
    for bad, status in ((["x " * MAX_WORD_TOKENS], 400), (["Paris", "  "], 400), ("Paris", 422), ([3], 422)):
        r = httpx.post(spec.url + "/v1/completions", json=dict(model=MODEL, prompt="Hi", max_tokens=2,
                                                                bad_words=bad), timeout=60)
        assert r.status_code == status and r.json()["error"]["param"] == "bad_words", r.text


def test_skip_special_tokens(spec):
    """vLLM's `skip_special_tokens` (through the openai client's extra_body): False keeps "<|im_end|>" in the text
    of a completion that a logit bias fills with it (end-of-sequence ignored); the default drops it."""
    tok = spec.engine.tokenizer
    end = tok.encode("<|im_end|>")
    assert len(end) == 1
    client = spec.client()
    texts = {}
    for skip in (True, False, None):
        extra = {"ignore_eos": True} | ({} if skip is None else {"skip_special_tokens": skip})
        out = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS[0], max_tokens=3, temperature=0,
                                        logit_bias={str(end[0]): 100}, extra_body=extra)
        texts[skip] = out.choices[0].text
    assert texts == {True: "", False: "<|im_end|>" * 3, None: ""}


def test_tokenize_and_detokenize(spec):
    """vLLM's /tokenize and /detokenize: a prompt's ids are the engine's own encoding (its usage counts them), chat
    messages go through the chat template as /v1/chat/completions applies it, and /detokenize reads the ids back.
    Bad bodies are 400s naming the field; a model without a tokenizer answers 400 too."""
    tok = spec.engine.tokenizer
    prompt = COMPLETION_PROMPTS[0]
    r = httpx.post(spec.url + "/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["tokens"] == tok.encode(prompt) and j["count"] == len(j["tokens"])
    assert j["max_model_len"] == spec.engine.max_model_len
    assert "".join(j["token_strs"]) == tok.decode(j["tokens"], skip_special_tokens=False)
    out = spec.client().completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens == j["count"]
    messages = [{"role": "user", "content": "Hi there"}]
    r = httpx.post(spec.url + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.json()["tokens"] == tok.encode(tok.apply_chat_template(messages))
    r = httpx.post(spec.url + "/detokenize", json={"tokens": j["tokens"]}, timeout=60)
    assert r.status_code == 200 and r.json()["prompt"] == prompt
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/tokenize", {"model": "nope", "prompt": "a"}, "model")):
        r = httpx.post(spec.url + path, json=body, timeout=60)
        assert r.status_code in (400, 404, 422) and r.json()["error"]["param"] == param, (path, body, r.text)


def test_continue_final_message(spec):
    """vLLM's `continue_final_message` (with `add_generation_prompt: false`): the model goes on writing the last
    message, whose text the prompt ends with, open; the reply equals offline `LLM.chat(continue_final_message=True)`
    (greedy). Both flags true is a 400."""
    tok = spec.engine.tokenizer
    begun = BEGUN
    text = tok.apply_chat_template(begun, add_generation_prompt=False, continue_final_message=True)
    closed = tok.apply_chat_template(begun, add_generation_prompt=False)
    assert text.endswith("The colour I name is") and closed.startswith(text) and len(closed) > len(text)
    r = httpx.post(spec.url + "/tokenize", json={"messages": begun, "add_generation_prompt": False,
                                                 "continue_final_message": True}, timeout=60)
    assert r.json()["tokens"] == tok.encode(text)
    out = spec.client().chat.completions.create(
        model=MODEL, messages=begun, max_tokens=8, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert out.choices[0].message.content == spec.refs["continue"].text
    r = httpx.post(spec.url + "/v1/chat/completions", json={"model": MODEL, "messages": begun,
                                                            "continue_final_message": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_echo_through_the_openai_client_on_smollm2(spec):
    """`completions.create(echo=True, logprobs=1, max_tokens=1)` on the real model: the text starts with the prompt
    as sent, the tokens are the prompt's (as its tokenizer splits it) and then the completion's, and the prompt
    tokens' log-probabilities are the engine's offline `prompt_logprobs`."""
    tok = spec.engine.tokenizer
    prompt = ECHO_PROMPT
    out = spec.client().completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                           temperature=0)
    choice = out.choices[0]
    ids = tok.encode(prompt)
    assert choice.text.startswith(prompt) and len(choice.logprobs.tokens) == len(ids) + 1
    assert choice.logprobs.tokens[:-1] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert choice.logprobs.token_logprobs[0] is None
    ref = spec.refs["echo"].prompt_logprobs  # offline, before the server took the engine
    assert choice.logprobs.token_logprobs[1:-1] == pytest.approx([e.logprob for e in ref[1:]], abs=1e-4)
    assert [list(t) for t in choice.logprobs.top_logprobs[1:-1]] == \
        [[tok.decode([i], skip_special_tokens=False) for i, _ in e.top] + ([] if e.top[0][0] == t else
                                                                          [tok.decode([t], skip_special_tokens=False)])
         for e, t in zip(ref[1:], ids[1:])]


def test_chat_logprobs_match_offline(spec):
    """`logprobs: true, top_logprobs: 3` through the openai client, plain and streamed: each token's text,
    log-probability and alternatives are the offline run's (tests/test_logprobs.py holds those to dense forwards)."""
    ref = spec.refs["logprobs"]
    tok = spec.engine.tokenizer
    client = spec.client()
    out = client.chat.completions.create(model=MODEL, messages=CONVERSATIONS[0], max_tokens=16, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == ref.text
    assert [c.token for c in content] == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    for c, e in zip(content, ref.logprobs):
        assert [a.token for a in c.top_logprobs] == [tok.decode([i], skip_special_tokens=False) for i, _ in e.top]
        assert c.bytes == list(c.token.encode())
    streamed = [lp for ch in client.chat.completions.create(model=MODEL, messages=CONVERSATIONS[0], max_tokens=16,
                                                            temperature=0, logprobs=True, top_logprobs=3, stream=True)
                if ch.choices and ch.choices[0].logprobs for lp in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    plain = client.chat.completions.create(model=MODEL, messages=CONVERSATIONS[0], max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    for body, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
        r = httpx.post(spec.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": CONVERSATIONS[0], "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    spec.wait_idle()


def test_stream_interval_sends_a_chunk_per_n_tokens(spec):
    """`--stream-interval 4` (`create_app(stream_interval=4)`) on the speculating server, whose steps commit 1-4
    tokens: the first token comes alone (TTFT), then each chunk carries at least 4 tokens but the last, with the
    tokens, log-probabilities and text of the offline run (a stream that a token per step would split finer)."""
    ref = spec.refs["logprobs"]
    tok = spec.engine.tokenizer
    loop = spec.app.state.server.async_engine
    assert loop.stream_interval == 1
    loop.stream_interval = 4
    try:
        chunks = [ch.choices[0] for ch in spec.client().chat.completions.create(
            model=MODEL, messages=CONVERSATIONS[0], max_tokens=16, temperature=0, logprobs=True, top_logprobs=3,
            stream=True) if ch.choices and ch.choices[0].logprobs]
    finally:
        loop.stream_interval = 1
    sizes = [len(c.logprobs.content) for c in chunks]
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == len(ref.token_ids), sizes
    streamed = [lp for c in chunks for lp in c.logprobs.content]
    assert [c.token for c in streamed] == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert [c.logprob for c in streamed] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    assert "".join(c.delta.content or "" for c in chunks) == ref.text
    spec.wait_idle()


# ---- the tiny server: admission control, failures, token-id prompts --------------------------------------------------

TINY_VOCAB = 64


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), vocab=TINY_VOCAB)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """max_num_seqs=1, max_queue=1: two requests in flight at most. Each engine step sleeps 20 ms."""
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_num_seqs=1, num_blocks=64)
    step = llm.engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    llm.engine.step = slow_step
    server = LiveServer(create_app(llm, "tiny", max_queue=1))
    server.tiny_dir = tiny_dir
    yield server
    server.close()


def _tiny_body(**kw):
    return {"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            **kw}


def test_token_id_prompts_and_usage(tiny):
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=5, prompt=[[1, 2, 3], [4, 5]]),
                   timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    assert [c["finish_reason"] for c in j["choices"]] == ["length", "length"]
    assert j["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    # no tokenizer: a clear 400 for chat and for text prompts
    r = httpx.post(tiny.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(prompt="hello"), timeout=60)
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(prompt=[TINY_VOCAB]), timeout=60)
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]})):
        r = httpx.post(tiny.url + path, json=body, timeout=60)
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    # vLLM's continuous_usage_stats (with include_usage): every chunk carries the usage so far, the last the whole
    # (logprobs: a chunk per step, since a model without a tokenizer writes no text)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    with httpx.stream("POST", tiny.url + "/v1/completions", timeout=60, json=_tiny_body(
            max_tokens=6, prompt=[[1, 2, 3], [4, 5]], logprobs=0, stream=True, stream_options=opts)) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    done = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] == 5 for e in events) and done == sorted(done) and done[-1] == 12
    assert len(set(done)) > 2 and events[-1]["choices"] == []
    with httpx.stream("POST", tiny.url + "/v1/completions", timeout=60, json=_tiny_body(
            max_tokens=2, stream=True, stream_options={"continuous_usage_stats": True})) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert events and not any("usage" in e for e in events)  # without include_usage: none (vLLM's rule)
    tiny.wait_idle()


def test_completion_logprobs_equal_a_dense_forwards(tiny):
    """/v1/completions with `logprobs: 2` on a model without a tokenizer (tokens named token_id:N): the chosen
    tokens' log-probabilities and the alternatives are a dense forward's log-softmax, and a stream's chunks hold
    the same, their text offsets running on."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    body = _tiny_body(max_tokens=6, prompt=prompt, logprobs=2)
    r = httpx.post(tiny.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    out = [int(t.split(":")[1]) for t in lp["tokens"]]
    assert len(out) == 6 and lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(6)]
    target = tiny.engine.target
    with torch.no_grad():
        ids = torch.tensor([prompt + out])
        ref = torch.log_softmax(target.compute_logits(target(ids, torch.arange(ids.shape[1])[None]))[0].float(), -1)
    ref = ref[len(prompt) - 1: -1]
    assert lp["token_logprobs"] == pytest.approx(ref.gather(1, torch.tensor(out)[:, None])[:, 0].tolist(), abs=1e-5)
    for j, top in enumerate(lp["top_logprobs"]):
        vals, idx = ref[j].topk(2)
        want = {f"token_id:{i}": v for i, v in zip(idx.tolist(), vals.tolist())}
        want.setdefault(lp["tokens"][j], lp["token_logprobs"][j])
        assert top == pytest.approx(want, abs=1e-5)
    with httpx.stream("POST", tiny.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]
    assert [x for p in parts for x in p["token_logprobs"]] == pytest.approx(lp["token_logprobs"], abs=1e-5)
    r = httpx.post(tiny.url + "/v1/completions", json={**body, "logprobs": 0}, timeout=60)
    lp0 = r.json()["choices"][0]["logprobs"]  # no alternatives: each position maps the chosen token alone
    assert lp0["top_logprobs"] == [{t: x} for t, x in zip(lp0["tokens"], lp0["token_logprobs"])]
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=2, logprobs=21), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    tiny.wait_idle()


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(tiny):
    """lm-evaluation-harness's loglikelihood request (`echo: true, logprobs: 1, max_tokens: 1`, the prompt as token
    ids): the text and the tokens are the prompt's and then the completion's; the first prompt token's
    log-probability and alternatives are null, every other prompt token's are a dense forward's; the harness's
    sum and greedy test read them. `max_tokens: 0` (OpenAI's legacy scoring): the prompt's part alone, no completion
    tokens; without echo, a 400. Without logprobs the text is still echoed. Streamed, the prompt's chunk comes first
    and the chunks add up to the same text and log-probabilities."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    body = _tiny_body(max_tokens=1, prompt=prompt, logprobs=1, echo=True)
    r = httpx.post(tiny.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    names = [f"token_id:{t}" for t in prompt]
    assert lp["tokens"][:-1] == names and len(lp["tokens"]) == len(prompt) + 1
    plain = httpx.post(tiny.url + "/v1/completions", json={**body, "echo": False}, timeout=60).json()["choices"][0]
    assert choice["text"] == "".join(names) + plain["text"]  # (a model without a tokenizer has no output text)
    assert lp["tokens"][-1] == plain["logprobs"]["tokens"][0]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(prompt) + 1)]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    target = tiny.engine.target
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = torch.log_softmax(target.compute_logits(target(ids, torch.arange(len(prompt))[None]))[0].float(), -1)
    want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert lp["token_logprobs"][1:-1] == pytest.approx(want.tolist(), abs=1e-5)
    for j in range(1, len(prompt)):
        vals, idx = ref[j - 1].topk(1)
        assert lp["top_logprobs"][j] == pytest.approx(
            {f"token_id:{idx.item()}": vals.item(), names[j]: want[j - 1].item()}, abs=1e-5)
    # the harness's reading: the continuation's log-likelihood, and whether it is the greedy one
    ctx = 3
    assert sum(lp["token_logprobs"][ctx:-1]) == pytest.approx(want[ctx - 1:].sum().item(), abs=1e-4)
    greedy = all(max(top.values()) == x for top, x in zip(lp["top_logprobs"][ctx:-1], lp["token_logprobs"][ctx:-1]))
    assert greedy == all(ref[j - 1].argmax().item() == prompt[j] for j in range(ctx, len(prompt)))
    r = httpx.post(tiny.url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=60)  # score only (legacy)
    assert r.status_code == 200, r.text
    only = r.json()
    assert only["choices"][0]["text"] == "".join(names) and only["usage"]["completion_tokens"] == 0
    assert {k: v[:-1] for k, v in lp.items()} == only["choices"][0]["logprobs"]
    r = httpx.post(tiny.url + "/v1/completions", json={**body, "max_tokens": 0, "echo": False}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=2, prompt=prompt, echo=True), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    assert r.json()["choices"][0]["text"].startswith("".join(names))
    # vLLM's prompt_logprobs (here 3, beside echo's 1): per prompt token {id: {logprob, rank, decoded_token}}, the
    # token and the 3 likeliest, a dense forward's; echo then lists as many alternatives (vLLM's precedence)
    r = httpx.post(tiny.url + "/v1/completions", json={**body, "prompt_logprobs": 3}, timeout=60)
    assert r.status_code == 200, r.text
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(prompt)
    for j in range(1, len(prompt)):
        row = ref[j - 1]
        vals, idx = row.topk(3)
        want = {str(i): (v, k + 1) for k, (i, v) in enumerate(zip(idx.tolist(), vals.tolist()))}
        want[str(prompt[j])] = (row[prompt[j]].item(), int((row > row[prompt[j]]).sum()) + 1)
        assert set(pl[j]) == set(want)
        for t, (v, rank) in want.items():
            assert pl[j][t]["logprob"] == pytest.approx(v, abs=1e-5) and pl[j][t]["rank"] == rank
            assert pl[j][t]["decoded_token"] == f"token_id:{t}"
    assert all(len(top) in (3, 4) for top in r.json()["choices"][0]["logprobs"]["top_logprobs"][1:-1])
    r = httpx.post(tiny.url + "/v1/completions", json={**body, "echo": False, "prompt_logprobs": 1}, timeout=60)
    assert r.json()["choices"][0]["prompt_logprobs"][1:] == [{k: v for k, v in d.items() if v["rank"] == 1 or k in (
        str(prompt[j]),)} for j, d in enumerate(pl[1:], 1)]  # the same entries, fewer alternatives, without echo
    for extra in ({"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}):
        r = httpx.post(tiny.url + "/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    for extra, whole in (({}, choice), ({"max_tokens": 0}, only["choices"][0])):  # streamed: the same, the
        with httpx.stream("POST", tiny.url + "/v1/completions", json={**body, **extra, "stream": True,  # prompt first
                                                                     "stream_options": {"include_usage": True}},
                          timeout=60) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        parts = [e["choices"][0] for e in events if e["choices"]]
        assert parts[0]["text"] == "".join(names) and parts[0]["logprobs"]["tokens"] == names
        assert "".join(p["text"] for p in parts) == whole["text"] and parts[-1]["finish_reason"] == "length"
        lps = [p["logprobs"] for p in parts if p["logprobs"]]
        got, want = {k: [x for p in lps for x in p[k]] for k in lp}, whole["logprobs"]
        assert (got["tokens"], got["text_offset"]) == (want["tokens"], want["text_offset"])
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-5)
        assert all(a == pytest.approx(b, abs=1e-5) for a, b in zip(got["top_logprobs"][1:], want["top_logprobs"][1:]))
        assert events[-1]["usage"]["completion_tokens"] == (0 if extra else 1)
    tiny.wait_idle()


def test_penalties_reach_the_engine(tiny):
    """presence / frequency / repetition penalties (tests/test_penalties.py holds the engine to its oracles): the
    server's output is the offline engine's with the same penalties; out-of-range values are 400s naming them."""
    prompt = [2, 7, 1, 8, 2, 8]
    pen = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.4}
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=12, prompt=prompt, logprobs=0, **pen),
                   timeout=60)
    assert r.status_code == 200, r.text
    got = [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    free = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=12, prompt=prompt, logprobs=0),
                      timeout=60).json()["choices"][0]["logprobs"]["tokens"]
    assert got != [int(t.split(":")[1]) for t in free]
    tiny.wait_idle()
    ref = LLM(str(tiny.tiny_dir), device="cpu", dtype="float32").generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True, **pen))[0].token_ids
    assert got == ref
    for name, bad in [("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
                      ("min_p", 1.5), ("logit_bias", {"x": 1.0}), ("logit_bias", {"3": 101.0}),
                      ("logit_bias", {str(TINY_VOCAB): 1.0}), ("logit_bias", {"-2": 1.0})]:
        r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=2, **{name: bad}), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    # vLLM's stop_token_ids end the output at the first of them; its min_tokens holds them off until then
    r = httpx.post(tiny.url + "/v1/completions", json={**_tiny_body(max_tokens=12, prompt=prompt, logprobs=0, **pen),
                                                       "ignore_eos": False, "stop_token_ids": [got[3]]}, timeout=60)
    assert r.status_code == 200, r.text
    stopped = [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    assert stopped == got[: got.index(got[3]) + 1] and r.json()["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(tiny.url + "/v1/completions", json={**_tiny_body(max_tokens=12, prompt=prompt, logprobs=0, **pen),
                                                       "stop_token_ids": [got[3]], "min_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text
    held = [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    tiny.wait_idle()
    assert got[3] not in held[:8] and held == LLM(str(tiny.tiny_dir), device="cpu", dtype="float32").generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[got[3]], min_tokens=8, **pen)
    )[0].token_ids
    for body in (_tiny_body(max_tokens=2, min_tokens=3), _tiny_body(max_tokens=2, min_tokens=-1)):
        r = httpx.post(tiny.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    # OpenAI's logit_bias (token ids as strings): the offline engine's output with the same bias
    bias = {"3": 4.0, str(got[0]): -100.0}
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=12, prompt=prompt, logprobs=0,
                                                                  logit_bias=bias), timeout=60)
    assert r.status_code == 200, r.text
    biased = [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    assert got[0] not in biased
    tiny.wait_idle()
    assert biased == LLM(str(tiny.tiny_dir), device="cpu", dtype="float32").generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={int(k): v for k, v in bias.items()})
    )[0].token_ids
    # vLLM's allowed_token_ids: the tokens are drawn from them alone; the others' log-probabilities are ruled out
    allowed = [5, 9, 40, got[1]]
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=12, prompt=prompt, logprobs=3,
                                                                  allowed_token_ids=allowed), timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    only = [int(t.split(":")[1]) for t in lp["tokens"]]
    assert set(only) <= set(allowed) and all(len(top) == 3 for top in lp["top_logprobs"])
    tiny.wait_idle()
    assert only == LLM(str(tiny.tiny_dir), device="cpu", dtype="float32").generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=allowed))[0].token_ids
    for bad in ([], [-1], [TINY_VOCAB]):
        r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=2, allowed_token_ids=bad), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    # bad_words are text: a model without a tokenizer refuses them
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=2, bad_words=["a"]), timeout=60)
    assert r.status_code == 400 and "needs the model's tokenizer" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "bad_words"


def test_priority_scheduling_through_the_server(tiny_dir, tiny):
    """vLLM's `priority` with `--scheduling-policy priority` (one place in the batch, slow steps): a low-priority
    request is running when three more arrive together; they finish by priority (the first preempting the running
    one), which finishes last, with its tokens unchanged. The default policy refuses a priority with a 400."""
    import asyncio
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_num_seqs=1, num_blocks=64,
              scheduling_policy="priority")
    step = llm.engine.step
    llm.engine.step = lambda: (time.sleep(0.02), step())[1]
    server = LiveServer(create_app(llm, "tiny", max_queue=8))
    try:
        async def main():
            done = []
            async with httpx.AsyncClient(timeout=120) as c:
                async def one(name, prio, delay):
                    await asyncio.sleep(delay)
                    r = await c.post(server.url + "/v1/completions", json=_tiny_body(
                        max_tokens=20 if name != "low" else 40, priority=prio, prompt=[3, 1, 4, 1, 5], logprobs=0))
                    assert r.status_code == 200, r.text
                    done.append(name)
                    return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
                got = await asyncio.gather(one("low", 9, 0), one("p5", 5, 0.3), one("p1", 1, 0.3), one("p3", 3, 0.3))
            return done, got
        done, got = asyncio.run(main())
        assert done == ["p1", "p3", "p5", "low"]
        assert llm.engine.scheduler.num_preemptions >= 1
        assert server.metrics()["eyas:num_preemptions_total{}"] == \
            llm.engine.scheduler.num_preemptions
        alone = LLM(str(tiny_dir), device="cpu", dtype="float32").generate(
            [[3, 1, 4, 1, 5]], SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
        assert got[0] == alone and got[1] == got[2] == got[3] == alone[:20]
    finally:
        server.close()
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=2, priority=1), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=2, priority=0),
                      timeout=60).status_code == 200


def test_truncate_prompt_tokens(tiny):
    """vLLM's `truncate_prompt_tokens`: only the prompt's last k tokens are read, so the output and the usage are
    those of the truncated prompt; a prompt that only fits the context once truncated is taken; k < 1 is a 400."""
    long = [(5 * i + 3) % TINY_VOCAB for i in range(40)]
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=6, prompt=long, logprobs=0,
                                                                  truncate_prompt_tokens=7), timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    got = [int(t.split(":")[1]) for t in j["choices"][0]["logprobs"]["tokens"]]
    assert j["usage"]["prompt_tokens"] == 7
    short = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=6, prompt=long[-7:], logprobs=0),
                       timeout=60).json()["choices"][0]["logprobs"]["tokens"]
    assert got == [int(t.split(":")[1]) for t in short]
    for bad in (0, -3):
        r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=2, truncate_prompt_tokens=bad),
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    tiny.wait_idle()


def test_usage_and_metrics_count_prefix_cache_hits(tiny):
    """A prompt sent again finds its full blocks cached (block size 16: 32 of its 40 tokens; the last one is always
    prefilled), in the usage of plain and streamed responses and in the prefix-cache counters."""
    prompt = [(7 * i + 3) % TINY_VOCAB for i in range(40)]
    before = tiny.wait_idle()
    for expect in (0, 32):
        r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=3, prompt=prompt), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": expect}
    chunks = list(tiny.client().completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    after = tiny.wait_idle()
    assert after["eyas:prefix_cache_queries_total{}"] - before["eyas:prefix_cache_queries_total{}"] == 3 * 40
    assert after["eyas:prefix_cache_hits_total{}"] - before["eyas:prefix_cache_hits_total{}"] == 2 * 32
    # POST /reset_prefix_cache (vLLM's): the next request finds nothing cached, the one after it finds it again
    r = httpx.post(tiny.url + "/reset_prefix_cache", timeout=60)
    assert r.status_code == 200 and r.json()["reset"] is True and r.json()["blocks"] >= 2, r.text
    for expect in (0, 32):
        r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=3, prompt=prompt), timeout=60)
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": expect}
    tiny.wait_idle()


def test_full_queue_gets_503_with_retry_after(tiny):
    tiny.wait_idle()
    with httpx.Client(timeout=60) as http:
        held = []
        try:
            for _ in range(2):  # one running, one waiting: the engine is full
                cm = http.stream("POST", tiny.url + "/v1/completions", json=_tiny_body(stream=True))
                r = cm.__enter__()
                held.append(cm)
                assert r.status_code == 200
            m = tiny.metrics()
            assert m["eyas:num_requests_running{}"] + m["eyas:num_requests_waiting{}"] == 2
            for stream in (False, True):
                r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=4, stream=stream),
                               timeout=60)
                assert r.status_code == 503, r.text
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert err["code"] == "server_overloaded" and "retry" in err["message"]
            with pytest.raises(openai.InternalServerError):  # 503, as the official client sees it
                tiny.client().completions.create(model="tiny", prompt=[1, 2], max_tokens=2)
        finally:
            for cm in held:
                cm.__exit__(None, None, None)
    m = tiny.wait_idle(timeout=30)
    assert m["eyas:request_success_total{finish_reason=abort}"] >= 2
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=3), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_engine_failure_fails_the_batch_not_the_server(tiny):
    tiny.wait_idle()
    engine = tiny.engine
    step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return step()

    engine.step = failing_step
    try:
        r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=3), timeout=60)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        calls["n"] = 0
        with httpx.stream("POST", tiny.url + "/v1/completions", json=_tiny_body(max_tokens=3, stream=True),
                          timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "injected failure" in json.loads(events[0][6:])["error"]["message"]
        assert events[-1] == "data: [DONE]"
    finally:
        engine.step = step
    m = tiny.wait_idle()
    assert m["eyas:request_success_total{finish_reason=error}"] == 2
    r = httpx.post(tiny.url + "/v1/completions", json=_tiny_body(max_tokens=3), timeout=60)
    assert r.status_code == 200 and httpx.get(tiny.url + "/health", timeout=10).json() == {"status": "ok"}


# ---- pieces --------------------------------------------------------------------------------------------------------

def _out(text: str, finished: bool):
    """A RequestOutput whose text so far is `text` (pieces of at most 3 characters, as the detokenizer keeps it)."""
    from eyas.engine.detokenizer import OutputText
    from eyas.engine.engine import RequestOutput
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    return RequestOutput("r", [], finished, None, 0, text=OutputText(pieces, len(pieces), len(text), "", len(text)))


def test_streamed_text_is_always_a_prefix_of_the_final_text(caplog):
    ts = TextStream(["STOP"])  # the engine trims "STOP" from the final text: never send its beginning
    assert ts.delta(_out("Hello ST", False)) == "Hello"
    assert ts.delta(_out("Hello STO", False)) == " "
    assert ts.delta(_out("Hello STO\ufffd", False)) == ""  # an incomplete character is held back too
    assert ts.delta(_out("Hello ", True)) == ""  # the final text, "STOP" trimmed: what was sent is its prefix
    ts = TextStream([])
    assert ts.delta(_out("ab\ufffd", False)) == "ab" and ts.delta(_out("abc", False)) == "c"
    assert ts.delta(_out("abc", True)) == ""
    long = "".join(chr(0x41 + i % 26) for i in range(100))
    assert "".join(ts.delta(_out("abc" + long[:k], k == 100)) for k in [*range(0, 100, 7), 100]) == long
    assert not caplog.records
    # the last character sent changed (the check reads the last CHECK sent): logged, only what is new is sent
    assert ts.delta(_out("abc" + long[:-1] + "X" + "d", True)) == "d" and "not a prefix" in caplog.text


def test_a_lagging_streams_waiting_outputs_come_as_one(tmp_path):
    """Every step's outputs of two choices (logprobs asked, tokenizer text) queued before the consumer reads
    any, as when the event loop falls behind: `results` yields fewer items than steps, and their new tokens, new
    logprobs and streamed text, joined, are each choice's whole output. A consumer never behind gets every output."""
    from conftest import smollm2_tokenizer
    from helpers import write_tiny_chat_model
    from eyas.serve.async_engine import AsyncEngine
    d = write_tiny_chat_model(tmp_path / "m", smollm2_tokenizer())
    llm = LLM(str(d), device="cpu", dtype="float32", num_blocks=64)

    def outputs():  # [(choice, RequestOutput)] of every step, in order (seeded: the same on every call)
        eng, items = llm.engine, []
        for j in range(2):
            eng.add_request("Once upon a time", SamplingParams(max_tokens=9 + 4 * j, temperature=0.9, seed=j,
                                                               logprobs=2), request_id=f"r{j}")
        while eng.has_unfinished():
            items += [(int(out.request_id[1]), out) for out in eng.step()]
        return items

    async def read(q, items, lag: bool):
        if lag:  # everything waits before the first read
            for item in items:
                q.put_nowait(item)
        got = {0: [], 1: []}

        async def feed():
            for item in items:
                q.put_nowait(item)
                for _ in range(5):  # the reader takes it before the next
                    await asyncio.sleep(0)

        task = None if lag else asyncio.create_task(feed())
        async for i, out in AsyncEngine.results(q, 2):
            got[i].append(out)
        if task is not None:
            await task
        return got

    items = outputs()
    merged = asyncio.run(read(asyncio.Queue(), items, lag=True))
    for i, outs in merged.items():
        final = outs[-1]
        assert final.finished and len(outs) < len([1 for j, _ in items if j == i])
        assert [t for o in outs for t in o.new_token_ids] == final.token_ids
        assert [lp.logprob for o in outs for lp in o.new_logprobs] == [lp.logprob for lp in final.logprobs]
        ts = TextStream([])
        assert "".join(ts.delta(o) for o in outs) == final.text
    items = outputs()
    on_time = asyncio.run(read(asyncio.Queue(), items, lag=False))
    assert sum(map(len, on_time.values())) == len(items)
    assert [t for o in on_time[1] for t in o.new_token_ids] == merged[1][-1].token_ids


@settings(max_examples=60, deadline=None)
@given(obs=st.lists(st.tuples(st.sampled_from([0.0, 0.001, 0.0049, 0.005, 0.03, 0.5, 7.5, 160.0, 161.0, 1e6]),
                              st.integers(1, 5)), max_size=30))
def test_repeated_histogram_reads_as_prometheus_clients_own(obs):
    """`RepeatedHistogram.observe(v, k)` (TTIT: k tokens at one gap) against prometheus-client's Histogram fed v
    k times: the same samples in the exposition, bounds included (Prometheus's buckets are <=)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from eyas.serve.metrics import LATENCY_BUCKETS, RepeatedHistogram
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = RepeatedHistogram("x_seconds", "doc", ("model_name", "m"), LATENCY_BUCKETS, ours)
    ref = Histogram("x_seconds", "doc", ["model_name"], buckets=LATENCY_BUCKETS, registry=theirs).labels("m")
    for v, k in obs:
        h.observe(v, k)
        for _ in range(k):
            ref.observe(v)

    def samples(reg):
        fam, = [f for f in text_string_to_metric_families(generate_latest(reg).decode()) if f.name == "x_seconds"]
        return fam.type, sorted((x.name, tuple(sorted(x.labels.items())), x.value) for x in fam.samples)

    (kind, got), (ref_kind, want) = samples(ours), samples(theirs)
    assert kind == ref_kind == "histogram" and [g[:2] for g in got] == [w[:2] for w in want]
    assert [g[2] for g in got] == pytest.approx([w[2] for w in want], rel=1e-12)  # the sum: k*v against k adds


def test_step_accounting_sums_every_requests_part(tmp_path):
    """The loop's metrics, summed over a step's requests and published once a step, equal the totals of the
    requests' own stats, with several requests (and depths) in each step."""
    from helpers import write_mirror_pair
    from eyas.serve.async_engine import AsyncEngine, _Tracker
    from eyas.serve.metrics import Metrics
    target, draft = write_mirror_pair(tmp_path, vocab=24, layers=2)
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="chain:4")
    engine, metrics = llm.engine, Metrics("m")
    ae = AsyncEngine(engine, metrics)
    prompts = [[i % 20 + 1, (3 * i) % 20 + 1, 5] for i in range(6)]
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=12 + 3 * i, ignore_eos=True, temperature=0.0 if i % 2 else 1.0,
                                             seed=i), request_id=f"r{i}")
        ae._trackers[f"r{i}"] = _Tracker(None, 0, time.perf_counter())
    finals = {}
    while engine.has_unfinished():
        outs = engine.step()
        finals.update({o.request_id: o for o in outs if o.finished})
        ae._dispatch(outs)
    assert len(finals) == len(prompts) and not ae._trackers
    got = {(f.name, tuple(sorted(f.labels.items()))): f.value
           for fam in text_string_to_metric_families(metrics.render().decode()) for f in fam.samples}

    def value(name, **labels):
        return got[(name, tuple(sorted({"model_name": "m", **labels}.items())))]

    stats = [o.stats for o in finals.values()]
    depth = engine.tree.max_depth
    assert value("eyas:generation_tokens_total") == sum(o.num_output_tokens for o in finals.values())
    assert value("eyas:prompt_tokens_total") == sum(map(len, prompts))
    assert value("eyas:time_per_output_token_seconds_count") == sum(o.num_output_tokens - 1 for o in finals.values())
    assert value("eyas:spec_target_calls_total") == sum(s.target_calls for s in stats)
    assert value("eyas:spec_committed_tokens_total") == sum(s.committed for s in stats)
    by_depth = [sum(s.accepted_by_depth[d] for s in stats) for d in range(depth)]
    assert [value("eyas:spec_accepted_tokens_by_depth_total", depth=str(d + 1)) for d in range(depth)] == by_depth
    assert by_depth[depth - 1] > 0  # full-depth paths were accepted: every depth was counted
    assert value("eyas:request_success_total", finish_reason="length") == len(prompts)


def test_decode_steps_by_tree_and_their_draft_forwards(tmp_path):
    """A dispatch with temperature bands: /metrics counts each tree's decode steps (every tree listed from the start,
    "plain" too: the draftless steps of requests that never speculate) and the draft forwards as each step's tree
    has levels (a plain step none)."""
    from helpers import write_mirror_pair
    from eyas.serve.async_engine import AsyncEngine, _Tracker
    from eyas.serve.metrics import Metrics
    target, draft = write_mirror_pair(tmp_path, vocab=24, layers=2)
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft),
              speculation="dispatch:1=chain:4,64=chain:2|0.9=plain")
    engine, metrics = llm.engine, Metrics("m")
    ae = AsyncEngine(engine, metrics)
    for i in range(3):
        engine.add_request([i + 1, 5, 7], SamplingParams(max_tokens=10 + 8 * i, ignore_eos=True,
                                                         temperature=1.0 if i == 0 else 0.0, seed=i),
                           request_id=f"r{i}")
        ae._trackers[f"r{i}"] = _Tracker(None, 0, time.perf_counter())

    def scrape():
        return {(f.name, tuple(sorted(f.labels.items()))): f.value
                for fam in text_string_to_metric_families(metrics.render().decode()) for f in fam.samples}

    key = ("eyas:spec_decode_steps_by_tree_total", (("model_name", "m"), ("tree", "plain")))
    assert scrape()[key] == 0
    while engine.has_unfinished():
        ae._dispatch(engine.step())
    assert scrape()[key] == 0  # the hot request always had a greedy one beside it
    engine.add_request([9, 5, 7], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.95, seed=3),
                       request_id="r3")  # alone: draftless plain steps
    ae._trackers["r3"] = _Tracker(None, 0, time.perf_counter())
    while engine.has_unfinished():
        ae._dispatch(engine.step())
    got = scrape()
    steps = {t: got[("eyas:spec_decode_steps_by_tree_total", (("model_name", "m"), ("tree", t)))]
             for t in ("chain:0", "chain:2", "chain:4", "plain")}
    assert steps == {t: engine.runner.tree_steps.get(t, 0) for t in steps} and min(steps.values()) > 0
    assert got[("eyas:spec_draft_forwards_total", (("model_name", "m"),))] == 2 * steps["chain:2"] + 4 * steps["chain:4"]
    assert got[("eyas:spec_verify_steps_total", (("model_name", "m"),))] == sum(steps.values())


@settings(max_examples=200, deadline=None)
@given(text=st.text(), model=st.sampled_from(["smollm2", 'a "quoted" model', "\ue000eyas-text\ue000"]),
       chat=st.booleans(), usage=st.booleans())
def test_text_chunk_events_equal_the_whole_encoding(text, model, chat, usage):
    """A streamed text chunk, encoded from its pieces around the text, is the event that encoding the whole chunk
    gives, for any text (quotes, backslashes, control characters, U+2028, astral characters) and chunk kind; a
    model name holding the marker falls back to the whole encoding."""
    from eyas.serve.api_server import _sse, _TextChunk

    def build(t, i=2):
        c = {"id": "chatcmpl-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
             "model": model, "choices": [{"index": i, "delta": {"content": t}, "logprobs": None, "finish_reason": None}
                                         if chat else {"index": i, "text": t, "logprobs": None, "finish_reason": None}]}
        if usage:
            c["usage"] = None
        return _sse(c)

    made = _TextChunk(build)
    assert made(text) == build(text) and (made.head is None) == ("\ue000" in model)


def test_api_key(tiny_dir, monkeypatch):
    """`eyas serve --api-key KEY` (or $EYAS_API_KEY): every endpoint but /health, /metrics and /version wants
    `Authorization: Bearer KEY`; a missing or wrong key is OpenAI's 401 (the openai client raises its
    AuthenticationError), the right one is served."""
    import argparse

    from eyas.serve.api_server import _api_key
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", num_blocks=32)
    server = LiveServer(create_app(llm, "tiny", api_key="s3cret"))
    try:
        body = _tiny_body(max_tokens=2)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for path in ("/v1/completions", "/v1/models", "/tokenize", "/reset_prefix_cache"):
                r = httpx.post(server.url + path, json=body, headers=headers, timeout=60) if path != "/v1/models" \
                    else httpx.get(server.url + path, headers=headers, timeout=60)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(server.url + path, timeout=60).status_code == 200, path
        r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"},
                       timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
        with pytest.raises(openai.AuthenticationError):
            server.client().completions.create(model="tiny", prompt=[1, 2], max_tokens=1)
        ok = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert ok.completions.create(model="tiny", prompt=[1, 2], max_tokens=1).usage.completion_tokens == 1
    finally:
        server.close()
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    monkeypatch.delenv("EYAS_API_KEY", raising=False)
    assert _api_key(parser.parse_args(["serve"])) is None
    assert _api_key(parser.parse_args(["serve", "--api-key", "k"])) == "k"
    monkeypatch.setenv("EYAS_API_KEY", "e")
    assert _api_key(parser.parse_args(["serve"])) == "e"


def test_serve_waits_for_the_warmup_before_it_freezes_and_serves(monkeypatch):
    """`eyas serve` (`_serve_app`) joins guided decoding's warm-up thread (`Server.wait_for_warmup`) before it
    freezes the heap and serves: its imports would otherwise share the first requests' CPU and stay unfrozen."""
    import types
    import uvicorn
    from eyas.serve import api_server
    done, calls = threading.Event(), []
    warm = threading.Thread(target=lambda: (time.sleep(0.2), done.set()))
    warm.start()
    server = types.SimpleNamespace(_grammar=warm)
    server.wait_for_warmup = lambda: (api_server.Server.wait_for_warmup(server), calls.append(("warm", done.is_set())))

    class Uvicorn:
        def __init__(self, config):
            pass

        def run(self, sockets):
            calls.append("serve")

    monkeypatch.setattr(uvicorn, "Server", Uvicorn)
    monkeypatch.setattr(api_server, "freeze_heap", lambda who: calls.append("freeze"))
    app = types.SimpleNamespace(state=types.SimpleNamespace(server=server))
    engine = types.SimpleNamespace(tree=types.SimpleNamespace(name="t"), draft=None)
    args = types.SimpleNamespace(host="127.0.0.1", port=0, served_model_name=None, model="m", tensor_parallel=1,
                                 log_level="warning")
    api_server._serve_app(app, engine, args)
    assert calls == [("warm", True), "freeze", "serve"]


def test_serve_command_line(tiny_dir):
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve"])
    assert args.func is run_serve and args.model == "smollm2" and args.draft == "auto"
    from eyas.serve.api_server import _engine_kwargs
    assert _engine_kwargs(args)["scheduling_policy"] == "fcfs" and "prefill_wait_ms" not in _engine_kwargs(args)
    assert _engine_kwargs(parser.parse_args(["serve", "--prefill-wait-ms", "2.5"]))["prefill_wait_ms"] == 2.5
    assert _engine_kwargs(parser.parse_args(["serve", "--scheduling-policy", "priority"]))["scheduling_policy"] == \
        "priority"
    assert (args.host, args.port, args.max_queue) == ("127.0.0.1", 8000, 256)
    from eyas.serve.api_server import _app_options
    assert _app_options(args)["stream_interval"] == 1
    assert _app_options(parser.parse_args(["serve", "--stream-interval", "4"]))["stream_interval"] == 4
    with pytest.raises(ValueError, match="--stream-interval must be >= 1"):
        _app_options(parser.parse_args(["serve", "--stream-interval", "0"]))
    assert _resolve_draft("smollm2", "none") is None
    assert _resolve_draft(str(tiny_dir), "auto") is None  # no shipped draft for other models
    from eyas.loader.resolve import default_draft_path
    assert _resolve_draft("smollm2", "auto") == ("default" if default_draft_path("smollm2") else None)


def test_eyas_serve_subprocess(tiny_dir):
    """`eyas serve` through the real command line, in its own process."""
    proc, port = start_serve(["--model", str(tiny_dir), "--num-blocks", "32"])
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("tp", [1, 2])
def test_eyas_serve_refuses_a_port_in_use_before_loading(tiny_dir, monkeypatch, capsys, tp):
    """A port in use or out of range stops `eyas serve` with a clear error before any model loads (as vLLM does),
    not after minutes of loading and capturing; with --tensor-parallel too, before any rank is spawned."""
    from eyas import cli
    from eyas.serve import api_server

    def loaded(*args, **kwargs):
        raise AssertionError("loaded the model before checking the port")
    monkeypatch.setattr(api_server, "build_llm", loaded)
    monkeypatch.setattr("eyas.dist.launch.run_ranks", loaded)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for bad, words in ((port, f"cannot listen on 127.0.0.1:{port}: Address already in use"),
                           (65536, "--port must be in 0..65535, got 65536")):
            args = ["serve", "--model", str(tiny_dir), "--device", "cpu", "--port", str(bad)]
            assert cli.main(args + (["--tensor-parallel", "2"] if tp == 2 else [])) != 0
            assert f"eyas: error: {words}" in capsys.readouterr().err


def test_serve_listens_where_it_was_told_and_names_a_free_port(tiny_dir, monkeypatch):
    """`--port 0` takes a free port, which the log line names; the socket bound before loading is the one served."""
    from eyas.serve import api_server
    served = {}

    class Server:
        def __init__(self, config):
            pass

        def run(self, sockets):
            served["port"] = sockets[0].getsockname()[1]
    monkeypatch.setattr("uvicorn.Server", Server)
    sock = api_server.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    assert port != 0
    with socket.socket() as other:  # bound already: nobody else gets it
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    with socket.socket() as early, pytest.raises(ConnectionRefusedError):  # not listening before uvicorn does
        early.connect(("127.0.0.1", port))
    engine = type("E", (), {"draft": None})()
    args = argparse.Namespace(tensor_parallel=1, served_model_name="tiny", model="x", host="127.0.0.1", port=0,
                              log_level="warning")
    app = argparse.Namespace(state=argparse.Namespace(server=argparse.Namespace(wait_for_warmup=lambda: None)))
    api_server._serve_app(app, engine, args, sock)
    assert served["port"] == port and sock.fileno() == -1  # closed once served


def test_eyas_serve_tensor_parallel(tmp_path):
    """`eyas serve --tensor-parallel 2` (2 gloo ranks on the CPU): the openai client gets, at TP = 2 with a draft
    (chain:3), the text that offline TP = 1 plain decoding writes; requests at once and a bad one (400) are served; an
    idle server keeps its ranks alive past the heartbeat; SIGTERM stops every process in bounded time."""
    from conftest import smollm2_tokenizer
    from helpers import write_random_draft, write_tiny_chat_model
    tok = smollm2_tokenizer()
    mdir = write_tiny_chat_model(tmp_path / "m", tok)  # 4 heads, 2 kv heads: shards over 2 ranks
    ddir = write_random_draft(tmp_path / "d", mdir)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    llm = LLM(str(mdir), device="cpu", dtype="float32")
    want = [o.text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))]
    proc, port = start_serve(["--model", str(mdir), "--draft", str(ddir), "--speculation", "chain:3",
                               "--num-blocks", "64", "--tensor-parallel", "2"], timeout=120)
    try:
        assert len(live_children(proc.pid)) >= 2  # the two ranks
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="hi", max_tokens=10, temperature=-1)
        r = httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache", timeout=30)  # rank 0 alone: refused
        assert r.status_code == 400 and "single engine" in r.json()["error"]["message"]
        time.sleep(3)  # idle: rank 0 keeps stepping (a heartbeat), so the other rank is not left waiting
        stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=10, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == want[0]
        kids = live_children(proc.pid)
        proc.terminate()
        assert proc.wait(60) == 0
        out = proc.stdout.read().decode()
        assert "Traceback" not in out, out  # rank 0 stopped the other rank before leaving (no broken collective)
        time.sleep(0.5)
        assert not [k for k in kids if Path(f"/proc/{k}").exists() and "zombie" not in
                    (Path(f"/proc/{k}/status").read_text() if Path(f"/proc/{k}").exists() else "zombie").lower()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


# ---- eyas bench serve: the clients' view of a server under load ----------------------------------------------------

@pytest.fixture(scope="module")
def chat_tiny(tmp_path_factory):
    """A tiny random model with SmolLM2's tokenizer and chat template, served with at most 8 requests a batch;
    every step notes the size of the running batch."""
    from conftest import smollm2_tokenizer
    from helpers import noting_batches, write_tiny_chat_model
    path = write_tiny_chat_model(tmp_path_factory.mktemp("chat_tiny"), smollm2_tokenizer())
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=8)
    batches = noting_batches(llm)
    server = LiveServer(create_app(llm, "tiny"))
    server.batches = batches
    yield server
    server.close()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bench_serve_counts_what_the_server_served(chat_tiny, tmp_path, endpoint):
    """`eyas bench serve` against a live server: every request completes with the tokens asked for, its totals are
    what the server's own metrics counted, no more requests run at once than --concurrency, and a second run's
    table shows the first beside it (--compare)."""
    from eyas.cli import main
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:5]))
    common = ["bench", "serve", "--base-url", chat_tiny.url + "/v1", "--model", "tiny", "--endpoint", endpoint,
              "--prompts", str(prompts), "--num-prompts", "12", "--max-tokens", "6", "--ignore-eos",
              "--concurrency", "3", "--no-progress"]
    before = chat_tiny.wait_idle()
    chat_tiny.batches.clear()
    assert main(common + ["--out", str(tmp_path / "a"), "--label", "first"]) == 0
    after = chat_tiny.wait_idle()
    res = json.loads((tmp_path / "a" / "serve.json").read_text())
    rows, s = res["requests"], res["summary"]
    assert len(rows) == 12 and s["completed"] == 12 and s["failed"] == 0
    assert all(r["output_tokens"] == 6 and r["error"] is None for r in rows)
    assert all(0 < r["ttft_s"] <= r["e2e_s"] and r["ttit_s"] is not None for r in rows)
    assert s["output_tokens"] == 72 == after["eyas:generation_tokens_total{}"] - before["eyas:generation_tokens_total{}"]
    assert after["eyas:request_success_total{finish_reason=length}"] - \
        before["eyas:request_success_total{finish_reason=length}"] == 12
    assert 1 <= max(chat_tiny.batches) <= 3
    assert s["output_tokens_per_s"] == pytest.approx(72 / s["duration_s"])
    # the server's own means over the run (its /metrics read before and after): each request's span inside the
    # client's, so never longer on average
    assert s["server"]["ttft_count"] == 12 and s["server"]["e2e_count"] == 12
    assert 0 < s["server"]["ttft_ms"] <= s["ttft_ms"]["mean"] and 0 < s["server"]["e2e_ms"] <= s["e2e_ms"]["mean"]
    steps = {k: int(after[f"eyas:engine_steps_total{{kind={k}}}"] - before[f"eyas:engine_steps_total{{kind={k}}}"])
             for k in ("decode", "prefill")}
    assert s["server"]["steps"] == steps and steps["prefill"] > 0 and steps["decode"] > 0  # the engine's, in the run
    assert (tmp_path / "a" / "serve.png").stat().st_size > 0
    assert main(common + ["--out", str(tmp_path / "b"), "--label", "second", "--num-prompts", "2",
                          "--compare", str(tmp_path / "a" / "serve.json")]) == 0
    table = (tmp_path / "b" / "serve.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["first", "second"]
    assert table[0].endswith("server's TTFT / e2e mean ms |") and table[2].split("|")[-2].strip() == \
        f"{s['server']['ttft_ms']:.1f} / {s['server']['e2e_ms']:.1f}"
    assert main(common + ["--out", str(tmp_path / "c"), "--num-prompts", "1", "--no-server-metrics"]) == 0
    assert json.loads((tmp_path / "c" / "serve.json").read_text())["summary"]["server"] is None


def test_bench_serve_keeps_a_connection_per_place(chat_tiny, tmp_path, monkeypatch):
    """Each of --concurrency's places keeps one connection alive, as a user's client would: every stream is read to
    its end (past `[DONE]`), so 8 requests at 2 places open at most 2 connections, not one each."""
    import uvicorn.protocols.http.h11_impl as h11_impl
    import uvicorn.protocols.http.httptools_impl as httptools_impl

    from eyas.cli import main
    opened = []
    for cls in (h11_impl.H11Protocol, httptools_impl.HttpToolsProtocol):
        def connection_made(self, transport, original=cls.connection_made):
            opened.append(transport.get_extra_info("peername"))
            return original(self, transport)
        monkeypatch.setattr(cls, "connection_made", connection_made)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:4]))
    chat_tiny.wait_idle()  # (reads /metrics on a connection of its own)
    opened.clear()
    assert main(["bench", "serve", "--base-url", chat_tiny.url + "/v1", "--model", "tiny", "--prompts", str(prompts),
                 "--num-prompts", "8", "--max-tokens", "4", "--concurrency", "2", "--no-progress",
                 "--no-server-metrics", "--out", str(tmp_path / "k")]) == 0
    assert json.loads((tmp_path / "k" / "serve.json").read_text())["summary"]["completed"] == 8
    assert 1 <= len(opened) <= 2, opened


def test_bench_serve_gives_up_on_a_stream_held_open_past_done(tmp_path, monkeypatch):
    """A server that keeps a stream open after `[DONE]` (tools/diag/sse_stub.py with a hold): each request still
    completes, its end at `[DONE]`, the client waiting `DRAIN_S` at most for the body's end before it drops the
    connection."""
    import importlib.util

    import eyas.bench.serve as bench_serve
    from eyas.cli import main
    spec = importlib.util.spec_from_file_location("sse_stub", Path(__file__).parents[1] / "tools/diag/sse_stub.py")
    stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)
    server = LiveServer(stub.Stub(tokens=3, step_s=0.001, hold_s=60.0))
    monkeypatch.setattr(bench_serve, "DRAIN_S", 0.2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    try:
        t = time.monotonic()
        assert main(["bench", "serve", "--base-url", server.url + "/v1", "--model", "stub", "--prompts", str(prompts),
                     "--num-prompts", "4", "--max-tokens", "3", "--concurrency", "2", "--no-progress",
                     "--out", str(tmp_path / "h")]) == 0
        assert time.monotonic() - t < 20
    finally:
        server.close()
    s = json.loads((tmp_path / "h" / "serve.json").read_text())["summary"]
    assert s["completed"] == 4 and s["output_tokens"] == 12 and s["server"] is None  # the stub has no /metrics
    assert s["e2e_ms"]["p99"] < 150  # ended at [DONE], not after the wait


def test_bench_serve_reads_a_peers_metrics(tmp_path):
    """`scrape_server` reads a peer's histograms by their names past the prefix (vLLM's `vllm:`), summed over their
    label sets, and gives None for a server without /metrics; `server_means` is the mean over the run."""
    import http.server
    import threading

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from eyas.bench.serve import scrape_server, server_means
    reg = CollectorRegistry()
    ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", ["model_name"], registry=reg)
    e2e = Histogram("vllm:e2e_request_latency_seconds", "e2e", ["model_name"], registry=reg)
    Histogram("vllm:time_per_output_token_seconds", "not read", ["model_name"], registry=reg).labels("a").observe(9)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path == "/metrics" and self.server.metrics
            body = generate_latest(reg) if found else b"no"
            self.send_response(200 if found else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.metrics = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        ttft.labels("a").observe(0.5)
        before = scrape_server(url)
        assert before == {"ttft": (0.5, 1.0), "e2e": (0.0, 0.0)}
        ttft.labels("a").observe(0.1)
        ttft.labels("b").observe(0.3)  # another label set: summed
        e2e.labels("b").observe(2.0)
        after = scrape_server(url + "/")
        assert after == {"ttft": (pytest.approx(0.9), 3.0), "e2e": (2.0, 1.0)}
        assert server_means(before, after) == {"ttft_ms": pytest.approx(200.0), "ttft_count": 2,
                                               "e2e_ms": pytest.approx(2000.0), "e2e_count": 1}
        assert server_means(before, before) == {"ttft_ms": None, "ttft_count": 0, "e2e_ms": None, "e2e_count": 0}
        assert server_means(None, after) is None
        httpd.metrics = False
        assert scrape_server(url) is None  # 404
    finally:
        httpd.shutdown()
    assert scrape_server(url, timeout=1.0) is None  # nothing listening


def test_bench_serve_split_over_client_processes(chat_tiny, tmp_path):
    """`--client-processes 2`: the conversations are shared out, each once, their arrivals on one clock (a Poisson
    process's starts as one client would send them), the concurrency shared out, and the totals are what the server
    counted."""
    from eyas.bench.serve import request_starts
    from eyas.cli import main
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:5]))
    before = chat_tiny.wait_idle()
    chat_tiny.batches.clear()
    assert main(["bench", "serve", "--base-url", chat_tiny.url + "/v1", "--model", "tiny", "--prompts", str(prompts),
                 "--num-prompts", "10", "--max-tokens", "5", "--ignore-eos", "--concurrency", "3",
                 "--request-rate", "40", "--client-processes", "2", "--no-progress", "--out", str(tmp_path / "m")]) == 0
    after = chat_tiny.wait_idle()
    res = json.loads((tmp_path / "m" / "serve.json").read_text())
    rows, s = res["requests"], res["summary"]
    assert sorted(r["conversation"] for r in rows) == list(range(10)) and s["failed"] == 0
    assert s["output_tokens"] == 50 == after["eyas:generation_tokens_total{}"] - before["eyas:generation_tokens_total{}"]
    planned = request_starts(10, 40.0, 0)
    for r in rows:  # each started at its planned time on the shared clock (or later, waiting for a free place)
        assert planned[r["conversation"]] - 0.005 <= r["start_s"] < planned[r["conversation"]] + 2.0
    assert min(r["start_s"] for r in rows) < 0.5  # the clock starts once every process is up, not before
    assert max(r["start_s"] + r["e2e_s"] for r in rows) <= s["duration_s"] + 1e-6
    assert 1 <= max(chat_tiny.batches) <= 3 and res["meta"]["client_processes"] == 2
    assert 0 < s["client_busy"] <= 1 and s["client_cpu_s"] > 0
    assert main(["bench", "serve", "--base-url", chat_tiny.url + "/v1", "--model", "tiny", "--prompts", str(prompts),
                 "--concurrency", "2", "--client-processes", "3", "--out", str(tmp_path / "x")]) == 2


def test_bench_serve_runs_conversations_of_several_turns(chat_tiny, tmp_path):
    """`--turns 2`: each conversation's second turn is sent after its first has ended, with the first and its
    answer, and the server's prefix cache holds what the two share (the usage's cached tokens, in the rows and the
    table)."""
    from eyas.cli import main
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [PROMPTS[i], PROMPTS[i + 2]]}) + "\n"
                               for i in range(2)))
    out = tmp_path / "t"
    engine, seen = chat_tiny.engine, []
    enqueue = engine.enqueue

    def noting_enqueue(seq):  # the server's requests, whose token ids hold prompt and output once they end
        seen.append(seq)
        return enqueue(seq)

    engine.enqueue = noting_enqueue
    try:
        assert main(["bench", "serve", "--base-url", chat_tiny.url + "/v1", "--model", "tiny", "--prompts",
                     str(prompts), "--num-prompts", "3", "--turns", "2", "--max-tokens", "6", "--ignore-eos",
                     "--concurrency", "2", "--no-progress", "--out", str(out)]) == 0
    finally:
        engine.enqueue = enqueue
    # each second turn's prompt holds a first turn's prompt and answer
    tok = engine.tokenizer
    texts = [(tok.decode(s.prompt_ids, skip_special_tokens=False), tok.decode(s.output_ids)) for s in seen]
    later = [p for p, _ in texts if PROMPTS[2] in p or PROMPTS[3] in p]
    assert len(later) == 3 and all(any(p1 in p and a1 in p for p1, a1 in texts if p1 != p) for p in later)
    res = json.loads((out / "serve.json").read_text())
    rows, s = res["requests"], res["summary"]
    assert len(rows) == 6 and s["failed"] == 0 and sorted(r["turn"] for r in rows) == [1, 1, 1, 2, 2, 2]
    firsts = {r["conversation"]: r for r in rows if r["turn"] == 1}
    seconds = [r for r in rows if r["turn"] == 2]
    for b in seconds:
        a = firsts[b["conversation"]]
        assert b["start_s"] >= a["start_s"] + a["e2e_s"]
    firsts = list(firsts.values())
    assert min(r["prompt_tokens"] for r in seconds) > max(r["prompt_tokens"] for r in firsts)
    assert all(r["cached_tokens"] >= 16 for r in seconds)
    assert s["cached_tokens"] == sum(r["cached_tokens"] for r in rows)
    assert set(s["ttft_ms_by_turn"]) == {"1", "2"}
    table = (out / "serve.md").read_text()
    assert "TTFT turns 2+" in table and f"{100 * s['cached_tokens'] / s['prompt_tokens']:.0f}%" in table


def test_bench_serve_reports_failures_and_bad_arguments(chat_tiny, tmp_path, capsys):
    """Requests the server refuses are counted with their error (exit 1); bad arguments exit 2 before any load."""
    from eyas.cli import main
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    common = ["bench", "serve", "--base-url", chat_tiny.url + "/v1", "--prompts", str(prompts), "--num-prompts", "3",
              "--max-tokens", "2", "--no-progress", "--out", str(tmp_path / "o")]
    assert main(common + ["--model", "no-such-model"]) == 1
    res = json.loads((tmp_path / "o" / "serve.json").read_text())
    assert res["summary"]["failed"] == 3 and all("HTTP 404" in r["error"] and "no-such-model" in r["error"]
                                                 for r in res["requests"])
    assert "3 of 3 requests failed" in capsys.readouterr().out
    assert main(common + ["--model", "tiny", "--concurrency", "0"]) == 2
    assert main(common + ["--model", "tiny", "--request-rate", "0"]) == 2
    assert main(common + ["--model", "tiny", "--turns", "2", "--endpoint", "completions"]) == 2
    assert main(common + ["--model", "tiny", "--compare", str(prompts)]) == 2
    assert "not a serve.json" in capsys.readouterr().err
    assert main(common + ["--model", "tiny", "--extra-body", "[1]"]) == 2
    assert main(common + ["--model", "tiny", "--extra-body", "{bad"]) == 2
    assert "--extra-body must be a JSON object" in capsys.readouterr().err
    # the fields reach every request: max_tokens 1 overrides --max-tokens 2; a bad value is the server's 400
    assert main(common + ["--model", "tiny", "--ignore-eos", "--extra-body", '{"max_tokens": 1}']) == 0
    res = json.loads((tmp_path / "o" / "serve.json").read_text())
    assert [r["output_tokens"] for r in res["requests"]] == [1, 1, 1] and res["meta"]["extra_body"] == {"max_tokens": 1}
    assert main(common + ["--model", "tiny", "--extra-body", '{"frequency_penalty": 9}']) == 1
    res = json.loads((tmp_path / "o" / "serve.json").read_text())
    assert all("frequency_penalty" in r["error"] for r in res["requests"])


def test_request_starts_are_a_poisson_process():
    from eyas.bench.serve import request_starts
    assert request_starts(5, float("inf"), 0) == [0.0] * 5
    starts = request_starts(4000, 20.0, 1)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert starts[0] == 0.0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.05)  # exponential gaps of mean 1 / rate
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(math.log(2) / 20.0, rel=0.08)  # and its median
    assert request_starts(10, 20.0, 1) == starts[:10]  # the seed fixes them
