"""Several HTTP processes in front of one engine process (`eyas serve --api-server-count N`; eyas.serve.api_servers):
each client of the engine gets its own requests' outputs, equal to the offline engine's; the engine's step counts
summed over the servers are the engine's own; a server that leaves loses its requests and frees their blocks; the
metrics of several processes are summed at a scrape; the command serves from every process and stops cleanly."""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eyas import LLM, SamplingParams
from eyas.serve.api_server import create_app
from eyas.serve.core_client import EngineLink, EngineProcess
from helpers import (LiveServer, live_children, start_serve, stop_cleanly, wait_gone, write_tiny_chat_model,
                     write_tiny_llama)

PROMPTS = [[5 + i, 9, 17 + 3 * i, 2] for i in range(8)]
MAX_TOKENS = [6 + 3 * i for i in range(8)]


def _step_counts(engine) -> dict:
    return dict(engine.step_counts)


def _call(server: LiveServer, fn):
    """`fn(engine)` in the engine process, through `server`'s loop."""
    loop = server.app.state.server.async_engine
    return asyncio.run_coroutine_threadsafe(loop.call(fn), loop._loop).result(60)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """One engine process (a tiny chat model on the CPU), two servers on it: `a` holds the `EngineProcess`
    (client 0), `b` a link of its own (client 1), both in this process."""
    from conftest import smollm2_tokenizer
    d = write_tiny_chat_model(tmp_path_factory.mktemp("two") / "m", smollm2_tokenizer(), max_pos=4096)
    kwargs = dict(model=str(d), device="cpu", dtype="float32", max_num_seqs=8, num_blocks=512)
    refs = LLM(**kwargs).generate(PROMPTS, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                                            for m in MAX_TOKENS])
    proc = EngineProcess(kwargs, log_level="warning", clients=2)
    a = LiveServer(create_app(proc, "tiny", max_queue=16))
    b = LiveServer(create_app(EngineLink(*proc.link_parts(1)), "tiny", max_queue=16))
    a.refs, a.proc, a.other = refs, proc, b
    yield a
    b.close()
    a.close()
    proc.close()
    assert not proc.proc.is_alive()


def test_each_server_gets_its_own_outputs_and_the_step_counts_add_up(two):
    """Eight requests at once, alternately on the two servers, half of them streamed: each gets the offline
    engine's text and token count. Afterwards each server has counted its own requests, and the engine's steps
    summed over both servers' /metrics equal the engine's own counts (each engine message carries what they moved
    since the last, to either server)."""
    a, b = two, two.other

    def one(i: int):
        server = (a, b)[i % 2]
        body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": 0,
                "ignore_eos": True}
        if i % 4 < 2:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]
        text, n = "", None
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
                    n = chunk["usage"]["completion_tokens"] if chunk.get("usage") else n
        return text, n

    results = [None] * len(PROMPTS)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, one(i))) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, ref in enumerate(a.refs):
        assert results[i] == (ref.text, len(ref.token_ids)), i
    _wait_idle(a)  # the engine's: each server's gauges are those of the last message it got (in one process)
    ma, mb = a.metrics(), b.metrics()
    for m, mine in ((ma, range(0, 8, 2)), (mb, range(1, 8, 2))):
        assert m["eyas:request_success_total{finish_reason=length}"] == len(mine)
        assert m["eyas:generation_tokens_total{}"] == sum(MAX_TOKENS[i] for i in mine)
    steps = _call(a, _step_counts)
    assert steps["prefill"] > 0 and steps["decode"] > 0
    for kind in ("prefill", "decode"):
        assert ma[f"eyas:engine_steps_total{{kind={kind}}}"] + mb[f"eyas:engine_steps_total{{kind={kind}}}"] == \
            steps[kind], kind


@pytest.mark.slow
def test_a_server_that_dies_loses_its_requests_and_frees_their_blocks(tmp_path):
    """Server `b`'s end of its pipe closes while two long streams of its own run, as when its process dies: the
    engine meets the broken pipe, aborts b's requests and frees their blocks, and server `a` serves on."""
    from conftest import smollm2_tokenizer
    d = write_tiny_chat_model(tmp_path / "m", smollm2_tokenizer(), max_pos=4096)
    proc = EngineProcess(dict(model=str(d), device="cpu", dtype="float32", max_num_seqs=4, num_blocks=512),
                         log_level="critical", clients=2)
    a = LiveServer(create_app(proc, "tiny", max_queue=4))
    link = EngineLink(*proc.link_parts(1))
    b = LiveServer(create_app(link, "tiny", max_queue=4))
    try:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with b.streams_left_midway(body, 2):
            assert _call(a, _used_blocks) > 0 and _call(a, _live_requests) == 2
            loop = b.app.state.server.async_engine._loop

            def die():  # b reads no more, and its end of the pipe is gone (its handlers abort nothing)
                loop.remove_reader(link.conn.fileno())
                link.conn.close()

            loop.call_soon_threadsafe(die)
            _wait_idle(a)  # else: the engine kept the requests of a server that died
            r = httpx.post(a.url + "/v1/completions", json={"model": "tiny", "prompt": [4, 5], "max_tokens": 3},
                           timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        b.server.force_exit = True
        b.close()
        a.close()
        proc.close()


def test_a_server_that_stops_on_a_signal_is_no_failure(monkeypatch):
    """The command's watch over its servers: one that exits 0 (Ctrl-C reached it too) stops nothing; one that
    exits otherwise is named, and the command is stopped (SIGTERM to itself)."""
    from eyas.serve import api_servers
    sent = []
    monkeypatch.setattr(api_servers.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    ctx = multiprocessing.get_context("spawn")
    for code, want in ((0, []), (3, [(os.getpid(), signal.SIGTERM)])):
        p = ctx.Process(target=sys.exit, args=(code,), name=f"server-{code}")
        p.start()
        died = []
        api_servers._watch([p], threading.Event(), died)
        assert sent == want and died == ([] if code == 0 else ["server-3"])
        p.join()
    stopping = threading.Event()
    stopping.set()  # the command stops them itself: nothing to say
    p = ctx.Process(target=sys.exit, args=(3,))
    p.start()
    died = []
    api_servers._watch([p], stopping, died)
    assert died == [] and len(sent) == 1
    p.join()
    # one stops on its own (0), another fails later: the watch goes on after the first, and names the second
    servers = [ctx.Process(target=sys.exit, args=(0,), name="quiet"),
               ctx.Process(target=_exit_after, args=(1.0, 5), name="failing")]
    for p in servers:
        p.start()
    died = []
    api_servers._watch(servers, threading.Event(), died)
    assert died == ["failing"] and len(sent) == 2
    for p in servers:
        p.join()


def _exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    sys.exit(code)


def _wait_idle(server: LiveServer, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _call(server, _used_blocks) or _call(server, _live_requests):
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def _used_blocks(engine) -> int:
    return engine.blocks.num_used


def _live_requests(engine) -> int:
    return len(engine.scheduler.running) + len(engine.scheduler.waiting)


def _count_in_process(path: str, tokens: int, running: int, calls: int, committed: int, k: int) -> None:
    """One server process's part of `test_metrics_of_several_processes_are_summed`."""
    from eyas.serve.metrics import Metrics, share_across_processes
    share_across_processes(path)
    m = Metrics("m")
    m.generation_tokens.inc(tokens)
    m.running.set(running)
    m.add_spec(calls, committed)
    m.ttit.observe(0.03, k)
    m.finished("stop").inc()


def test_metrics_of_several_processes_are_summed(tmp_path, monkeypatch):
    """Two processes count into the shared files, then this one: a scrape here reads the sums (counters and
    histograms), the gauge set last, and TPC from the summed counters (not any process's own ratio)."""
    from prometheus_client import values

    import eyas.serve.metrics as metrics
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)  # restored after: this process's metrics go back
    monkeypatch.setattr(metrics, "_MULTIPROCESS_DIR", None)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    ctx = multiprocessing.get_context("spawn")
    for args in ((100, 3, 10, 40, 2), (7, 5, 30, 30, 4)):  # TPC 4.0 and 1.0 alone
        p = ctx.Process(target=_count_in_process, args=(str(tmp_path), *args))
        p.start()
        p.join(60)
        assert p.exitcode == 0
    metrics.share_across_processes(str(tmp_path))
    m = metrics.Metrics("m")
    m.generation_tokens.inc(1)
    m.running.set(2)  # the last set
    samples = {s.name + str(sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
               for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    assert samples["eyas:generation_tokens_total[]"] == 108
    assert samples["eyas:num_requests_running[]"] == 2
    assert samples["eyas:spec_tokens_per_call[]"] == pytest.approx(70 / 40)
    assert samples["eyas:spec_target_calls_total[]"] == 40
    assert samples["eyas:time_per_output_token_seconds_count[]"] == 6
    assert samples["eyas:time_per_output_token_seconds_bucket[('le', '0.04')]"] == 6
    assert samples["eyas:time_per_output_token_seconds_bucket[('le', '0.02')]"] == 0
    assert samples["eyas:time_per_output_token_seconds_sum[]"] == pytest.approx(0.18)
    assert samples["eyas:request_success_total[('finish_reason', 'stop')]"] == 2


def test_api_server_count_refuses_what_it_cannot_run():
    """--api-server-count below 1, or above 1 with --no-engine-process, --tensor-parallel or --disaggregate: a
    clear error before anything loads."""
    from eyas.serve.api_server import parse_serve_args, run_serve
    for argv, match in ((["--api-server-count", "0"], "must be >= 1"),
                        (["--api-server-count", "2", "--no-engine-process"], "combine with --no-engine-process"),
                        (["--api-server-count", "2", "--tensor-parallel", "2"],
                         "--api-server-count > 1 does not combine with --tensor-parallel"),
                        (["--api-server-count", "2", "--disaggregate", "cpu,cpu"],
                         "--api-server-count > 1 does not combine with --disaggregate")):
        with pytest.raises(ValueError, match=match):
            run_serve(parse_serve_args(["--model", "no-such-model", *argv]))


def _get(port: int, path: str, **kw) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=30, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c", "a server killed"])
def test_eyas_serve_api_server_count_command_line(tmp_path, how):
    """`eyas serve --api-server-count 2`: with the first server stopped (SIGSTOP), the second serves alone; every
    scrape, whichever process answers it, counts every request. SIGTERM to the command or Ctrl-C to its process
    group stops it cleanly (exit 0, no traceback, none left behind); a server killed stops the command with exit 1."""
    d = write_tiny_llama(tmp_path / "m", vocab=64, hidden=32, layers=1)
    proc, port = start_serve(["--model", str(d), "--api-server-count", "2", "--num-blocks", "32"], timeout=120,
                              group=True)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}
    try:
        kids = live_children(proc.pid)
        servers = _listening(kids, port)  # the second server: the child that holds the listening socket
        assert len(servers) == 1, kids
        for _ in range(4):  # new connections: the kernel hands them to either process
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        os.kill(proc.pid, signal.SIGSTOP)  # the first server (and the engine's owner) stops taking connections
        try:
            for _ in range(3):
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            stopped = _get(port, "/metrics").text  # the second server's scrape, the first's counts in it
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        for text in [stopped] + [_get(port, "/metrics").text for _ in range(4)]:
            got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.labels.get("finish_reason", "length") == "length"}
            assert got["eyas:request_success_total"] == 7 and got["eyas:generation_tokens_total"] == 28
        if how == "a server killed":
            os.kill(servers[0], signal.SIGKILL)
            assert proc.wait(60) == 1
            assert "ended while serving" in proc.stdout.read().decode()
        else:
            stop_cleanly(proc, how)
        wait_gone(kids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _listening(pids: list[int], port: int) -> list[int]:
    """Those of `pids` that hold the socket listening on `port` (from /proc/net/tcp and each one's descriptors)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and f[3] == "0A":  # LISTEN
            inodes.add(f"socket:[{f[9]}]")
    held = []
    for pid in pids:
        try:
            links = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
        except OSError:
            continue
        if links & inodes:
            held.append(pid)
    return held


def test_the_engine_core_refuses_an_add_from_a_server_that_left(tmp_path):
    """The engine's loop in this process (a thread), two clients: after client 1 detaches, an add it sent late is
    refused (nobody would read its outputs) and nothing is added; client 0's add goes on as before."""
    import queue
    from multiprocessing import Pipe

    from eyas.serve.engine_core import EngineCore
    engine = LLM(str(write_tiny_llama(tmp_path / "m", vocab=64, hidden=32, layers=1)), device="cpu",
                 dtype="float32", num_blocks=32).engine
    commands, pipes = queue.Queue(), [Pipe(duplex=False) for _ in range(2)]
    core = EngineCore(engine, commands, [w for _, w in pipes])
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    commands.put(("detach", 1))
    commands.put(("add", 1, 7, [("late", [1, 2, 3], SamplingParams(max_tokens=25, temperature=0))]))
    commands.put(("add", 0, 8, [("mine", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))]))
    got, reader = {}, pipes[0][0]
    while "mine" not in got:  # client 0's messages: its add's answer, then its request's outputs
        msg = reader.recv()
        if msg[0] == "acks":
            got.update({tag: (err, result) for tag, err, result in msg[1]})
        elif msg[0] == "step":
            got.update({m[0]: m[3] for m in msg[1] if m[3]})
    commands.put(("call", 0, 9, _live_requests))  # what the engine holds once client 0's request is done
    while 9 not in got:
        msg = reader.recv()
        if msg[0] == "acks":
            got.update({tag: (err, result) for tag, err, result in msg[1]})
    commands.put(("stop",))
    loop.join(30)
    assert got[8] == (None, None) and got[9] == (None, 0)  # the late add was never taken
    with pytest.raises(EOFError):  # and client 1 heard nothing: its pipe was closed at once
        pipes[1][0].recv()
