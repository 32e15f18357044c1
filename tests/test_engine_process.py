"""The engine in a process of its own (`eyas serve --engine-process`; eyas.serve.engine_core and core_client): what
the clients get equals what the offline engine writes, and it fails, frees and counts as the in-process loop does."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest

from eyas import LLM, SamplingParams
from eyas.sampling_params import GuidedDecoding
from eyas.serve.api_server import create_app
from eyas.serve.core_client import EngineProcess
from helpers import (LiveServer, live_children, start_serve, stop_cleanly, wait_gone, write_tiny_chat_model,
                     write_tiny_llama)

MODEL = "smollm2"
TREE_PATHS = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]  # a small branching tree: several tokens a step, cheap on a CPU
PROMPTS = ["Hello, my name is", "List three fruits:", "The quick brown fox", "1, 2, 3, 4,",
           "Write a haiku about the sea:\n", "In 1969, the first humans"]


def cases() -> list[dict]:
    """12 clients: chat or completion, streamed or not, greedy or seeded sampling, a stop string on some, logprobs
    on some, a regex guide on one (the child compiles it again)."""
    return [dict(chat=i % 2 == 1, stream=i % 3 != 0, prompt=PROMPTS[i % 6], max_tokens=6 + (i * 5) % 11,
                 temperature=0.0 if i % 3 == 1 else 0.8, seed=500 + i, stop=["\n"] if i % 4 == 2 else None,
                 logprobs=2 if i % 5 == 0 else None, regex=r"[0-9]{2,6}( apples)?" if i == 4 else None)
            for i in range(12)]


N_SEED = 77


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tree = tmp_path_factory.mktemp("ep") / "tree.json"
    tree.write_text(json.dumps(TREE_PATHS))
    kwargs = dict(model=MODEL, device="cpu", dtype="float32", draft="default", speculation=str(tree), max_num_seqs=16,
                  num_blocks=256, max_model_len=512, overlap=True)
    llm = LLM(**kwargs)  # the offline references: every case in one batch
    tok = llm.tokenizer
    cs = cases()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c["prompt"]}])) if c["chat"]
               else c["prompt"] for c in cs]
    params = [SamplingParams(max_tokens=c["max_tokens"], temperature=c["temperature"], seed=c["seed"], stop=c["stop"],
                             logprobs=c["logprobs"], guided=c["regex"] and GuidedDecoding(regex=c["regex"]))
              for c in cs]
    refs = llm.generate(prompts, params)
    # n = 3 samples of one request: choice j as an offline request seeded N_SEED + j
    n_refs = llm.generate([PROMPTS[0]] * 3, [SamplingParams(max_tokens=10, temperature=0.9, seed=N_SEED + j)
                                              for j in range(3)])
    del llm
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the child's: it shares 2 cores with this process's server and clients
    try:
        proc = EngineProcess(kwargs, log_level="warning")
    finally:
        os.environ.pop("OMP_NUM_THREADS") if old is None else os.environ.__setitem__("OMP_NUM_THREADS", old)
    server = LiveServer(create_app(proc, MODEL, max_queue=16))
    server.refs, server.n_refs, server.proc = refs, n_refs, proc
    yield server
    server.close()
    proc.close()
    assert not proc.proc.is_alive()


async def _one(client, c) -> tuple[str, str, int, list | None]:
    """(text, finish reason, completion tokens, the tokens' logprobs) of one case, as its client gets them."""
    kw = dict(model=MODEL, max_tokens=c["max_tokens"], temperature=c["temperature"], seed=c["seed"], stop=c["stop"])
    if c["regex"]:
        kw.update(extra_body={"guided_regex": c["regex"]})
    lps = None
    if c["chat"]:
        kw.update(messages=[{"role": "user", "content": c["prompt"]}])
        if c["logprobs"]:
            kw.update(logprobs=True, top_logprobs=c["logprobs"])
        create = client.chat.completions.create
    else:
        kw.update(prompt=c["prompt"], logprobs=c["logprobs"])
        create = client.completions.create
    if not c["stream"]:
        r = await create(**kw)
        ch = r.choices[0]
        text = ch.message.content if c["chat"] else ch.text
        if c["logprobs"]:
            lps = ([t.logprob for t in ch.logprobs.content] if c["chat"] else ch.logprobs.token_logprobs)
        return text, ch.finish_reason, r.usage.completion_tokens, lps
    text, finish, usage = "", None, None
    stream = await create(stream=True, stream_options={"include_usage": True}, **kw)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += (ch.delta.content or "") if c["chat"] else ch.text
            finish = ch.finish_reason or finish
            if c["logprobs"] and ch.logprobs is not None:
                lps = (lps or []) + ([t.logprob for t in ch.logprobs.content or []] if c["chat"]
                                     else ch.logprobs.token_logprobs)
    return text, finish, usage.completion_tokens, lps


@pytest.mark.slow
@pytest.mark.parametrize("interval", [1, 3])
def test_clients_get_what_the_offline_engine_writes(served, interval):
    """12 clients at once (SmolLM2 and its draft, speculating): each gets the offline engine's text, finish reason,
    token count and logprobs, streamed or not; the metrics the parent keeps count what was served. With a stream
    interval of 3 the parent holds outputs back and folds them into the next (`dispatch`): the same."""
    before = served.wait_idle()
    loop = served.app.state.server.async_engine

    async def main():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.wait_for(asyncio.gather(*(_one(client, c) for c in cases())), timeout=400)

    loop.stream_interval = interval
    try:
        results = asyncio.run(main())
    finally:
        loop.stream_interval = 1
    for c, (text, finish, n, lps), ref in zip(cases(), results, served.refs):
        assert (text, finish, n) == (ref.text, ref.finish_reason, len(ref.token_ids)), c
        if c["regex"]:
            assert re.fullmatch(c["regex"], text), text
        if c["logprobs"]:
            assert lps == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-5), c
    m = served.wait_idle()
    tokens = m["eyas:generation_tokens_total{}"] - before["eyas:generation_tokens_total{}"]
    assert tokens == sum(len(r.token_ids) for r in served.refs)
    assert m["eyas:time_to_first_token_seconds_count{}"] - before["eyas:time_to_first_token_seconds_count{}"] == 12
    calls = m["eyas:spec_target_calls_total{}"] - before["eyas:spec_target_calls_total{}"]
    steps = m["eyas:engine_steps_total{kind=decode}"] - before["eyas:engine_steps_total{kind=decode}"]
    assert 0 < steps < tokens / 2 and calls >= steps  # batched, and several tokens a verify call
    assert m["eyas:spec_accepted_tokens_by_depth_total{depth=1}"] > 0


@pytest.mark.slow
def test_n_choices_whole_and_streamed(served):
    """One request, n = 3 seeded choices (one add of three requests in the child; their outputs interleave on one
    queue): each choice is the offline request seeded N_SEED + j, whole and streamed."""
    refs = served.n_refs
    assert len({r.text for r in refs}) > 1  # the seeds do differ
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0.9, seed=N_SEED, n=3)
    r = served.client().completions.create(**kw)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [x.text for x in refs]
    assert r.usage.completion_tokens == sum(len(x.token_ids) for x in refs)
    texts = [""] * 3
    for c in served.client().completions.create(stream=True, **kw):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [x.text for x in refs]


def _frozen_objects(engine) -> int:
    import gc
    return gc.get_freeze_count()


def test_the_engine_process_froze_its_heap(served):
    """The child froze what start-up made before it said "ready" (eyas.engine.heap): its full garbage collections
    while serving scan only what serving allocates."""
    import asyncio
    loop = served.app.state.server.async_engine._loop
    fut = asyncio.run_coroutine_threadsafe(served.app.state.server.async_engine.call(_frozen_objects), loop)
    assert fut.result(30) > 10_000  # the model, the tokenizer, the engine: ~300k objects on this CPU


@pytest.mark.slow
def test_disconnects_free_their_blocks_and_bad_input_is_a_400(served):
    before = served.wait_idle()
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with served.streams_left_midway(body, 2):
        during = served.metrics()
        assert during["eyas:kv_cache_used_blocks{}"] > 0 and during["eyas:num_requests_running{}"] == 2
    after = served.wait_idle(timeout=60)  # the child's blocks, as its state messages report them
    aborted = "eyas:request_success_total{finish_reason=abort}"
    assert after[aborted] - before[aborted] == 2
    # the child stopped them: a few steps more, where their 2 x 400 tokens would have taken well over a hundred
    decode = "eyas:engine_steps_total{kind=decode}"
    assert after[decode] - during[decode] < 40, after[decode] - during[decode]

    # the child refuses a priority without the priority policy (the parent does not check it): its ValueError is
    # the client's 400
    r = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                         "priority": 1}, timeout=30)
    assert r.status_code == 400 and "scheduling policy" in r.json()["error"]["message"], r.text
    # a call crosses to the child and back: a 40-token prompt's two full blocks stay cached after it, then go
    r = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": list(range(100, 140)),
                                                         "max_tokens": 1}, timeout=30)
    assert r.status_code == 200
    r = httpx.post(served.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json()["blocks"] >= 2, r.text
    ref = served.refs[1]  # case 1: a greedy chat request
    out = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                                  max_tokens=cases()[1]["max_tokens"], temperature=0)
    assert out.choices[0].message.content == ref.text


def test_a_dead_engine_process_fails_its_requests_and_health(tmp_path):
    """The child killed mid-stream: the stream ends in an error, /health says 503, and new requests get 503; the
    server itself lives on."""
    # SmolLM2's tokenizer (a model without one streams no text before its end), and a context long enough that the
    # stream is still going when the child is killed
    from conftest import smollm2_tokenizer
    d = write_tiny_chat_model(tmp_path / "m", smollm2_tokenizer(), max_pos=4096)
    proc = EngineProcess(dict(model=str(d), device="cpu", dtype="float32", max_num_seqs=2, num_blocks=512),
                         log_level="critical")
    server = LiveServer(create_app(proc, "tiny", max_queue=1))
    try:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(proc.proc.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert "error" in rest[-2] or "error" in rest[-1], rest[-3:]
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503
    finally:
        server.close()
        proc.close()


def test_an_engine_that_cannot_start_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="failed to start(.|\n)*no-such-model"):
        EngineProcess(dict(model=str(tmp_path / "no-such-model"), device="cpu", dtype="float32"), log_level="critical")
    with pytest.raises(ValueError, match="prefill_process"):
        EngineProcess(dict(model="smollm2", prefill_process=True))


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_eyas_serve_engine_process_command_line(tmp_path, how):
    """`eyas serve --engine-process`: it serves, and Ctrl-C (SIGINT to the process group, as a terminal sends it) or
    SIGTERM to the server alone (`kill`, `docker stop`) stops the server and its engine process cleanly (exit code
    0, no traceback, no leaked semaphore of the command queue), none left behind."""
    d = write_tiny_llama(tmp_path / "m", vocab=64, hidden=32, layers=1)
    proc, port = start_serve(["--model", str(d), "--engine-process", "--num-blocks", "32"], group=True)
    try:
        kids = live_children(proc.pid)
        assert kids  # the engine process (and the spawn machinery's helper)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        stop_cleanly(proc, how, timeout=30)
        wait_gone(kids)  # no engine process outlives the server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_engine_process_refuses_what_it_cannot_run_yet():
    """--engine-process with --tensor-parallel or --disaggregate: a clear error before anything loads."""
    import argparse
    from eyas.serve.api_server import add_serve_parser, run_serve
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    for extra, what in ((["--tensor-parallel", "2"], "--tensor-parallel"),
                        (["--disaggregate", "cpu,cpu"], "--disaggregate"),
                        (["--prefill-process"], "--prefill-process")):
        args = parser.parse_args(["serve", "--engine-process", "--port", "0", *extra])
        with pytest.raises(ValueError, match=f"--engine-process does not combine with {what}"):
            run_serve(args)


def test_the_engine_process_is_the_default_on_a_gpu(monkeypatch):
    """Without --engine-process or --no-engine-process, the engine gets a process of its own where it runs on a GPU
    and nothing it does not combine with is asked; on the CPU (tests, small machines) it stays in the server's."""
    import argparse

    import torch
    from eyas.serve.api_server import add_serve_parser, use_engine_process
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())

    def use(*argv, gpu: bool) -> bool:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        return use_engine_process(parser.parse_args(["serve", *argv]))

    assert use(gpu=True) and use("--device", "cuda", gpu=True)
    assert not use(gpu=False) and not use("--device", "cpu", gpu=True)
    assert not use("--tensor-parallel", "2", gpu=True) and not use("--disaggregate", "cuda:0,cuda:1", gpu=True)
    assert not use("--no-engine-process", gpu=True) and use("--engine-process", gpu=False)
