"""`eyas bench serve`: what the clients of an OpenAI-compatible server see, under load. The same requests go to any
server that streams `/v1/chat/completions` or `/v1/completions` (`eyas serve`, vLLM's, SGLang's), so peers are
compared on equal terms. The client is httpx with the events parsed by hand (the openai package's client took ~20%
more CPU a streamed chunk, ~0.13 ms, which on a small machine set the pace instead of the server); the summary says
how busy it kept a core (`client_busy`), and a note warns above 80%. Each of `--concurrency`'s places keeps one
connection alive and reads every stream to its end, as the openai package does (until session 71 it stopped at
`[DONE]`, which closed the connection: every request opened a new one); a request's end is its `[DONE]`.

    eyas serve --model smollm2 --draft default &
    eyas bench serve --base-url http://127.0.0.1:8000/v1 --model smollm2 --label eyas \\
        --prompts ../shared/data/mt_bench/question.jsonl --num-prompts 80 --max-tokens 128 --concurrency 16
    eyas bench serve ... --label vllm --base-url http://127.0.0.1:8001/v1 --compare bench-out/serve/serve.json

Each request streams (`stream_options.include_usage`, so the server counts its own output tokens). Requests start at
the times of a Poisson process of `--request-rate` requests/s (`inf`: all at once), at most `--concurrency` in flight.
Per request: TTFT (the start to its first text), TTIT ((end - first text) / (output tokens - 1)) and the end-to-end
time; over the run: requests/s and output tokens/s from the first start to the last end, and each latency's mean and
percentiles. It writes `serve.json` (the summary and every request), `serve.md` (a table, one row per run, with the
runs of `--compare`) and `serve.png` (the distributions of TTFT and TTIT of every run). A request that fails is
counted with its error, and the command exits 1 if any did.

Prompt records with a guide (`json_schema`, `json_object`, `regex`, `choice`, `grammar`: docs/bench/json_tasks.jsonl)
are sent as structured-output requests, in the fields vLLM reads too (`response_format` for JSON, `guided_regex`,
`guided_choice`, `guided_grammar`), and each output is checked against its guide (`guided_valid` in the summary; an
output cut by `--max-tokens` counts as invalid); `--no-guided` sends the same prompts free.

`--turns 2` runs conversations: each record's second user turn (MT-Bench's) is sent, with the first and its answer,
once that answer has ended. Its prompt begins with the previous one, so a server with a prefix cache prefills only
the new part: the table shows the later turns' TTFT apart, and the share of prompt tokens the server found cached
(the usage's `prompt_tokens_details.cached_tokens`, which eyas and vLLM report).

The server's own view: its Prometheus `/metrics` is read before and after the run, and the means of its TTFT and
end-to-end histograms over the run (`eyas:`, `vllm:` or `sglang:time_to_first_token_seconds`, `..._e2e_request_...`)
go into the summary (`server`) and the table beside the client's. What the client measured beyond them is the HTTP
path and the client itself; a server without those metrics leaves them out (`--no-server-metrics` never asks).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)
BUSY_WARNING = 0.8  # the client's CPU share of the run above which its own work may have set the pace
DRAIN_S = 2.0  # how long a stream's body may go on past `[DONE]` before the client drops its connection
# each request's send on the system's monotonic clock (`time.monotonic()`), in a header a server ignores: one on the
# same machine can tell how long requests took to reach its handler (tools/diag/serve_steps.py)
SENT_HEADER = "x-eyas-bench-sent"
# the server's latency histograms read from its /metrics, by their names past the prefix (eyas:, vllm:, sglang:)
SERVER_HISTOGRAMS = {"time_to_first_token_seconds": "ttft", "e2e_request_latency_seconds": "e2e"}
# eyas's engine steps by kind (a prefill step stalls every stream: how many a run took says what its arrivals cost)
SERVER_STEPS = "engine_steps"


def request_starts(n: int, rate: float, seed: int) -> list[float]:
    """When each of n requests starts, in seconds from the run's start: a Poisson process of `rate` requests/s (its
    gaps exponential), or all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _drain(lines) -> None:
    async for _ in lines:
        pass


async def _stream_request(client, url: str, body: dict, on_text, finished=None, ended=None,
                          headers: dict | None = None) -> dict | None:
    """POST one streamed request and read its server-sent events: `on_text(piece)` for each text, `finished[0]` :=
    the choice's finish reason (when given a list), `ended[0]` := when `[DONE]` (or the body's end) came (when given
    a list); returns the usage chunk's usage (None if none came). Raises RuntimeError with the server's message on an
    HTTP error or an error event. The body is read to its end past `[DONE]`, so that the connection is kept for the
    next request (left unread, httpx closes it); a server that holds the stream open after `[DONE]` gets `DRAIN_S`,
    then the connection is closed."""
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raw = (await r.aread()).decode(errors="replace")
            try:
                raw = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise RuntimeError(f"HTTP {r.status_code}: {raw}")
        usage, lines = None, r.aiter_lines()
        async for line in lines:
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event: {event['error'].get('message')}")
            if event.get("usage"):
                usage = event["usage"]
            for c in event.get("choices", ()):
                piece = c["delta"].get("content") if "delta" in c else c.get("text")
                if piece:
                    on_text(piece)
                if finished is not None and c.get("finish_reason"):
                    finished[0] = c["finish_reason"]
        if ended is not None:
            ended[0] = time.perf_counter()
        try:
            await asyncio.wait_for(_drain(lines), DRAIN_S)
        except asyncio.TimeoutError:  # the connection goes with the response
            pass
        return usage


def guided_fields(g, chat: bool = True) -> dict:
    """A `GuidedDecoding`'s request fields: JSON as OpenAI's chat API asks it (`response_format`; on /completions,
    vLLM's `guided_json`), the others as vLLM's extensions."""
    if g.json is not None or g.json_object:
        schema = {"type": "object"} if g.json is None else g.json if isinstance(g.json, dict) else json.loads(g.json)
        if not chat:
            return {"guided_json": schema}
        if g.json is None:
            return {"response_format": {"type": "json_object"}}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}
    if g.regex is not None:
        return {"guided_regex": g.regex}
    if g.choice is not None:
        return {"guided_choice": list(g.choice)}
    return {"guided_grammar": g.grammar}


async def _request(client, args, messages: list[dict] | str, t0: float, guided=None) -> tuple[dict, str]:
    """One streamed request (a chat's messages, or a completion's prompt): its row and its output's text."""
    body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
            "stream": True, "stream_options": {"include_usage": True}}
    if guided is not None:
        body.update(guided_fields(guided, args.endpoint == "chat"))
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body_fields)  # --extra-body: e.g. log-probabilities or penalties on every request
    if args.endpoint == "chat":
        body["messages"], path = messages, "/chat/completions"
    else:
        body["prompt"], path = messages, "/completions"
    first = last = None  # when the first and the latest text arrived
    pieces = []

    def on_text(piece: str) -> None:
        nonlocal first, last
        last = time.perf_counter()
        first = first or last
        pieces.append(piece)

    start = time.perf_counter()
    usage, error, finished, ended = None, None, [None], [None]
    try:
        usage = await _stream_request(client, args.base_url.rstrip("/") + path, body, on_text, finished, ended,
                                      {SENT_HEADER: f"{time.monotonic():.6f}"})
    except Exception as e:  # the server's error or the connection's: counted, never lost
        error = f"{type(e).__name__}: {e}"
    end = ended[0] or time.perf_counter()
    if error is None and usage is None:
        error = "the stream ended without a usage chunk (stream_options.include_usage)"
    text = "".join(pieces)
    tokens = usage.get("completion_tokens") if usage else None
    details = (usage or {}).get("prompt_tokens_details") or {}
    row = {"start_s": start - t0, "e2e_s": end - start, "output_tokens": tokens, "error": error,
           "ttft_s": None if first is None else first - start, "ttit_s": None, "chars": len(text),
           "finish_reason": finished[0], "prompt_tokens": usage.get("prompt_tokens") if usage else None,
           "cached_tokens": details.get("cached_tokens")}
    if error is None and first is not None and tokens and tokens > 1:
        row["ttit_s"] = (last - first) / (tokens - 1)
    if guided is not None:
        from eyas.bench.tpc import matches_guide
        row["guided"] = guided.kind
        row["guided_valid"] = error is None and finished[0] == "stop" and matches_guide(guided, text)
    return row, text


async def _conversation(places: asyncio.Queue, args, index: int, turns: list[str], start_at: float, t0: float,
                        guided=None) -> list[dict]:
    """A client's conversation: its first `args.turns` user turns, each sent once the answer to the one before
    has ended, with the conversation so far (one request, and one row, a turn; a failed turn ends it). It holds one
    of the `--concurrency` places (`places`: an httpx client of one kept-alive connection each) throughout."""
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    rows, messages = [], []
    client = await places.get()
    try:
        for k, user in enumerate(turns[:args.turns]):
            if args.endpoint == "chat":
                messages.append({"role": "user", "content": user})
                row, text = await _request(client, args, messages, t0, guided)
                messages.append({"role": "assistant", "content": text})
            else:
                row, _ = await _request(client, args, user, t0, guided)
            row["conversation"], row["turn"] = index, k + 1
            rows.append(row)
            if row["error"] is not None:
                break
    finally:
        places.put_nowait(client)
    return rows


async def _run(args, prompts: list[list[str]], guides: list | None = None, starts: list[float] | None = None,
               indices: list[int] | None = None, t0: float | None = None,
               on_done=None) -> tuple[list[dict], float, float]:
    """`prompts`: each conversation's user turns (`_conversation` sends the first `args.turns`), which start at
    `starts` (s after `t0`; default: `request_starts`, and now) and are numbered `indices` (default 0, 1, ...);
    `on_done()` is called as each ends (default: a progress bar). Returns the rows, the seconds from `t0` to the
    last end, and this process's CPU seconds."""
    import contextlib

    import httpx
    from tqdm import tqdm
    # a client of one connection per place: a request reuses its place's connection (as a user's client would),
    # and no pool of many connections is scanned for each request (httpcore polls every idle one: ~2 ms of CPU a
    # request at 32 places, once the connections were kept alive)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    starts = request_starts(len(prompts), args.request_rate, args.seed) if starts is None else starts
    indices = list(range(len(prompts))) if indices is None else indices
    tls = httpx.create_ssl_context()  # one for every place: each client would load the CA bundle (~23 ms)
    async with contextlib.AsyncExitStack() as stack:
        places: asyncio.Queue = asyncio.Queue()
        for _ in range(args.concurrency):
            places.put_nowait(await stack.enter_async_context(
                httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers, verify=tls)))
        cpu0 = time.process_time()
        t0 = time.perf_counter() if t0 is None else t0
        guides = guides or [None] * len(prompts)
        tasks = [asyncio.ensure_future(_conversation(places, args, i, p, s, t0, g))
                 for i, p, s, g in zip(indices, prompts, starts, guides)]
        rows = []
        with tqdm(total=len(tasks), desc="conversations" if args.turns > 1 else "requests",
                  disable=args.no_progress or on_done is not None) as bar:
            for fut in asyncio.as_completed(tasks):
                rows += await fut
                bar.update(1)
                if on_done is not None:
                    on_done()
        duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rows.sort(key=lambda r: r["start_s"])
    return rows, duration, cpu


def _client_process(args, prompts, guides, starts, indices, ready, go, t0, done, results, k: int) -> None:
    """One of `--client-processes`: says it is `ready`, waits (`go`) until the parent, once every one is ready, has set
    the shared start `t0` (one clock: `time.perf_counter` is the system's monotonic clock on Linux), runs its share,
    and puts (k, rows, seconds, CPU seconds), or (k, None, traceback)."""
    import traceback
    try:
        import httpx  # noqa: F401  (imported before the start, not inside the timed run)
        import tqdm  # noqa: F401
        ready.wait(timeout=300)
        go.wait(timeout=300)

        def on_done():
            with done.get_lock():
                done.value += 1

        rows, duration, cpu = asyncio.run(_run(args, prompts, guides, starts, indices, t0.value, on_done))
        results.put((k, rows, duration, cpu))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((k, None, traceback.format_exc()))
        ready.abort()  # a parent still waiting for the start hears of it at once
        go.abort()


def _run_processes(args, prompts: list[list[str]], guides: list) -> tuple[list[dict], float, float, float]:
    """`_run` split over `args.client_processes` spawned processes (conversation i to process i mod N, the
    concurrency shared out): one Python client's event loop parses every streamed chunk, and at tens of thousands of
    chunks a second it sets the pace instead of the server. Returns the rows, the run's seconds, the processes' CPU
    seconds together, and the busiest process's share of the run (`client_busy`)."""
    import multiprocessing as mp
    import queue as queue_mod
    from tqdm import tqdm
    n = args.client_processes
    ctx = mp.get_context("spawn")
    starts = request_starts(len(prompts), args.request_rate, args.seed)
    ready, go = ctx.Barrier(n + 1), ctx.Barrier(n + 1)
    t0, done, results = ctx.Value("d", 0.0), ctx.Value("i", 0), ctx.Queue()
    procs = []
    for k in range(n):
        idx = list(range(k, len(prompts), n))
        sub = argparse.Namespace(**{**vars(args), "concurrency": args.concurrency // n + (k < args.concurrency % n)})
        sub.func = None  # not picklable where the CLI set it
        procs.append(ctx.Process(target=_client_process, name=f"eyas-bench-client-{k}", daemon=True,
                                 args=(sub, [prompts[i] for i in idx], [guides[i] for i in idx],
                                       [starts[i] for i in idx], idx, ready, go, t0, done, results, k)))
    for pr in procs:
        pr.start()
    got: dict[int, tuple] = {}
    try:
        try:  # every process started (spawned, its imports done): only then the shared start, a little ahead
            ready.wait(timeout=300)
            t0.value = time.perf_counter() + 0.05
            go.wait(timeout=300)
        except Exception:
            try:
                k, *res = results.get(timeout=5)
                why = f"client process {k} failed:\n{res[-1]}"
            except queue_mod.Empty:
                why = "the client processes did not start"
            raise RuntimeError(why) from None
        with tqdm(total=len(prompts), desc="conversations" if args.turns > 1 else "requests",
                  disable=args.no_progress) as bar:
            while len(got) < n:
                try:
                    k, *res = results.get(timeout=0.2)
                    got[k] = tuple(res)
                except queue_mod.Empty:
                    dead = [pr for pr in procs if not pr.is_alive() and pr.exitcode != 0]
                    if dead and results.empty():
                        raise RuntimeError(f"client process {dead[0].name} died (exit code {dead[0].exitcode})")
                bar.n = done.value
                bar.refresh()
    finally:
        for pr in procs:
            pr.join(5)
            if pr.is_alive():
                pr.terminate()
    for k, res in sorted(got.items()):
        if res[0] is None:
            raise RuntimeError(f"client process {k} failed:\n{res[1]}")
    rows = sorted((r for res in got.values() for r in res[0]), key=lambda r: r["start_s"])
    duration = max(res[1] for res in got.values())
    return rows, duration, sum(res[2] for res in got.values()), max(res[2] for res in got.values()) / duration


def scrape_server(base_url: str, api_key: str = "unused", timeout: float = 10.0) -> dict | None:
    """{"ttft": (sum s, count), "e2e": (sum s, count), "steps": {kind: count}} from the server's Prometheus
    `/metrics` (the API's root, `base_url` without `/v1`), summed over every label set of each histogram in
    `SERVER_HISTOGRAMS`, and eyas's engine steps by kind (`SERVER_STEPS`, where the server counts them); None when
    the server answers none of them."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    root = base_url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    try:
        r = httpx.get(root + "/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)
        if r.status_code != 200:
            return None
        found: dict[str, list[float] | dict[str, float]] = {}
        for family in text_string_to_metric_families(r.text):
            if family.name.split(":")[-1] == SERVER_STEPS and family.type == "counter":
                steps = found.setdefault("steps", {})
                for sample in family.samples:
                    if sample.name.endswith("_total") and "kind" in sample.labels:
                        kind = sample.labels["kind"]
                        steps[kind] = steps.get(kind, 0.0) + sample.value
                continue
            key = SERVER_HISTOGRAMS.get(family.name.split(":")[-1])
            if key is None or family.type != "histogram":
                continue
            acc = found.setdefault(key, [0.0, 0.0])
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    acc[0] += sample.value
                elif sample.name.endswith("_count"):
                    acc[1] += sample.value
    except (httpx.HTTPError, ValueError):  # unreachable, or not Prometheus' text format
        return None
    return {k: v if k == "steps" else tuple(v) for k, v in found.items()} or None


def server_means(before: dict | None, after: dict | None) -> dict | None:
    """The server's means over the run, in ms, from two `scrape_server` readings: {"ttft_ms": .., "e2e_ms": ..,
    "ttft_count": .., "e2e_count": ..} (None where a histogram saw nothing new), and "steps": the engine's steps by
    kind in the run where the server counts them; None without both readings."""
    if before is None or after is None:
        return None
    out = {}
    for key in SERVER_HISTOGRAMS.values():
        (s0, c0), (s1, c1) = before.get(key, (0.0, 0.0)), after.get(key, (0.0, 0.0))
        out[f"{key}_ms"] = 1000.0 * (s1 - s0) / (c1 - c0) if c1 > c0 else None
        out[f"{key}_count"] = int(c1 - c0)
    if "steps" in after:
        out["steps"] = {k: int(v - before.get("steps", {}).get(k, 0.0)) for k, v in sorted(after["steps"].items())}
    return out


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def summarize(rows: list[dict], duration: float, client_cpu: float = 0.0, client_busy: float | None = None) -> dict:
    """Over the run: counts, rates from the first start to the last end, each latency's mean and percentiles in ms
    (TTIT over the requests with at least two output tokens; TTFT also by turn), the prompt tokens and those the
    server's prefix cache held (its usage's `cached_tokens`; None where a server does not report them), and the
    share of the run the client itself kept a core busy (`client_busy`: its process's CPU time over the run's; with
    several client processes, the busiest one's)."""
    ok = [r for r in rows if r["error"] is None]
    tokens = sum(r["output_tokens"] for r in ok)
    return {"requests": len(rows), "completed": len(ok), "failed": len(rows) - len(ok),
            "duration_s": duration, "requests_per_s": len(ok) / duration, "output_tokens": tokens,
            "output_tokens_per_s": tokens / duration, "client_cpu_s": client_cpu,
            "client_busy": client_cpu / duration if client_busy is None else client_busy,
            "guided": sum("guided" in r for r in rows), "guided_valid": sum(bool(r.get("guided_valid")) for r in rows),
            "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
            "cached_tokens": (sum(r["cached_tokens"] for r in ok) if ok and all(r.get("cached_tokens") is not None
                                                                                 for r in ok) else None),
            "ttft_ms": _stats([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
            "ttft_ms_by_turn": {str(k): _stats([r["ttft_s"] for r in ok if r.get("turn", 1) == k
                                                and r["ttft_s"] is not None])
                                for k in sorted({r.get("turn", 1) for r in rows})},
            "ttit_ms": _stats([r["ttit_s"] for r in ok if r["ttit_s"] is not None]),
            "e2e_ms": _stats([r["e2e_s"] for r in ok])}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _cached_share(s: dict) -> str:
    if s.get("cached_tokens") is None or not s.get("prompt_tokens"):
        return "-"
    return f"{100 * s['cached_tokens'] / s['prompt_tokens']:.0f}%"


def _server_cell(server: dict | None) -> str:
    return " - |" if not server else f" {_fmt(server['ttft_ms'])} / {_fmt(server['e2e_ms'])} |"


def markdown(runs: list[dict]) -> str:
    """A row per run. With conversations of several turns, TTFT of the later turns (the prompts that begin with
    the conversation so far) gets a column of its own."""
    turns = max(r["meta"].get("turns", 1) for r in runs)
    later = " | TTFT turns 2+ mean / p50 ms" if turns > 1 else ""
    served = any(r["summary"].get("server") for r in runs)
    head = ("| run | requests (failed) | concurrency | rate /s | output tokens/s | TTFT mean / p50 / p99 ms" + later +
            " | TTIT mean / p50 / p99 ms | e2e p50 / p99 ms | prompt tokens cached |" +
            (" server's TTFT / e2e mean ms |" if served else ""))
    lines = [head, "| --- " * (9 + bool(later) + served) + "|"]
    for run in runs:
        s, m = run["summary"], run["meta"]
        t, i, e = s["ttft_ms"], s["ttit_ms"], s["e2e_ms"]
        cols = ""
        if later:
            rows = [r for r in run["requests"] if r.get("turn", 1) > 1 and r["error"] is None and r["ttft_s"]]
            t2 = _stats([r["ttft_s"] for r in rows])
            cols = f" {_fmt(t2['mean'])} / {_fmt(t2['p50'])} |"
        lines.append(f"| {m['label']} | {s['requests']} ({s['failed']}) | {m['concurrency']} | {m['request_rate']} | "
                     f"{s['output_tokens_per_s']:.1f} | {_fmt(t['mean'])} / {_fmt(t['p50'])} / {_fmt(t['p99'])} |"
                     f"{cols} {_fmt(i['mean'])} / {_fmt(i['p50'])} / {_fmt(i['p99'])} | {_fmt(e['p50'])} / "
                     f"{_fmt(e['p99'])} | {_cached_share(s)} |" + (_server_cell(s.get("server")) if served else ""))
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    """The empirical distribution (CDF) of TTFT and of TTIT, a line per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttft_s", "time to first token"), (axes[1], "ttit_s", "time per output token")):
        for run in runs:
            v = np.sort([r[key] * 1000.0 for r in run["requests"] if r["error"] is None and r[key] is not None])
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=run["meta"]["label"])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:  # every request failed
            ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_runs(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        try:
            runs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"--compare {p}: not a serve.json ({e})") from None
        if not {"meta", "summary", "requests"} <= set(runs[-1]):
            raise ValueError(f"--compare {p}: not a serve.json (it needs meta, summary and requests)")
    return runs


def run(args) -> int:
    from eyas.bench.tpc import read_prompts
    try:
        import httpx  # noqa: F401  (the client: `pip install httpx`, or eyas's `bench` or `test` extra)
    except ImportError:
        raise ValueError("eyas bench serve needs the httpx package: pip install httpx") from None
    if args.concurrency < 1 or args.num_prompts < 1 or args.max_tokens < 1 or args.turns < 1:
        raise ValueError("--concurrency, --num-prompts, --max-tokens and --turns must be at least 1")
    if not 1 <= args.client_processes <= args.concurrency:
        raise ValueError(f"--client-processes must be between 1 and --concurrency ({args.concurrency}), got "
                         f"{args.client_processes}")
    if args.turns > 1 and args.endpoint != "chat":
        raise ValueError("--turns above 1 needs --endpoint chat (a later turn is sent with the conversation so far)")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    try:
        args.extra_body_fields = json.loads(args.extra_body)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body must be a JSON object: {e}") from None
    if not isinstance(args.extra_body_fields, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    earlier = read_runs(args.compare)  # a bad file fails before the load
    records = read_prompts(args.prompts)
    chosen = [records[i % len(records)] for i in range(args.num_prompts)]  # cycled past the file's end
    guides = [r["guided"] if args.guided else None for r in chosen]
    before = None if args.no_server_metrics else scrape_server(args.base_url, args.api_key)
    if args.client_processes > 1:
        rows, duration, cpu, busy = _run_processes(args, [r["turns"] for r in chosen], guides)
    else:
        rows, duration, cpu = asyncio.run(_run(args, [r["turns"] for r in chosen], guides))
        busy = None
    server = None if before is None else server_means(before, scrape_server(args.base_url, args.api_key))
    meta = {"label": args.label or args.base_url, "base_url": args.base_url, "model": args.model,
            "endpoint": args.endpoint, "prompts": str(args.prompts), "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
            "concurrency": args.concurrency, "request_rate": args.request_rate, "seed": args.seed,
            "turns": args.turns, "extra_body": args.extra_body_fields, "client_processes": args.client_processes,
            "guided": sum(g is not None for g in guides),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    result = {"meta": meta, "summary": {**summarize(rows, duration, cpu, busy), "server": server}, "requests": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(result, indent=2))
    runs = earlier + [result]
    (out / "serve.md").write_text(markdown(runs))
    plot(runs, out / "serve.png")
    print(markdown(runs), end="")
    if result["summary"]["client_busy"] > BUSY_WARNING:
        print(f"note: this client kept a core {100 * result['summary']['client_busy']:.0f}% busy: it may have limited "
              "the rates; split it (--client-processes), run it on cores the server does not use (taskset), or on "
              "another machine")
    s = result["summary"]
    if server is not None and server["ttft_count"] != s["completed"]:
        print(f"note: the server counted {server['ttft_count']} first tokens during the run against this client's "
              f"{s['completed']} completed requests: other traffic, or requests it never saw; its means cover them")
    if s["guided"]:
        print(f"guided outputs valid: {s['guided_valid']} of {s['guided']}")
    failed = [r for r in rows if r["error"] is not None]
    if failed:
        print(f"{len(failed)} of {len(rows)} requests failed; the first: {failed[0]['error']}")
        return 1
    return 0


def add_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser("serve", help="load an OpenAI-compatible server (ours or a peer's) and measure what "
                                           "its clients see: TTFT, TTIT, tokens/s")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="smollm2", help="the model name the server serves")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--prompts", default="../shared/data/mt_bench/question.jsonl",
                   help="MT-Bench questions, conversations or {\"prompt\": ...} lines (first user turns)")
    p.add_argument("--num-prompts", type=int, default=80,
                   help="requests, or conversations with --turns (the prompts cycled past the file's end)")
    p.add_argument("--turns", type=int, default=1,
                   help="user turns per conversation (MT-Bench has 2): each is sent once the answer to the one "
                        "before has ended, with the conversation so far, which a prefix cache holds; a "
                        "conversation holds one of --concurrency's places throughout")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="every request takes --max-tokens (a vLLM extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="the requests' sampling seed and the arrivals' seed")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--client-processes", type=int, default=1,
                   help="split the client over this many processes (conversation i to process i mod N, the "
                        "concurrency shared out), for loads whose streamed chunks one Python process cannot parse "
                        "as fast as the server sends them")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson), or inf")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--label", default=None, help="this run's name in the table and plot (default: the URL)")
    p.add_argument("--compare", nargs="*", default=[], help="earlier serve.json files to show beside this run")
    p.add_argument("--no-guided", dest="guided", action="store_false",
                   help="send prompts with a guide (json_schema, regex, ...) free: the same prompts unconstrained")
    p.add_argument("--extra-body", default="{}",
                   help='JSON fields added to every request, e.g. \'{"logprobs": true, "top_logprobs": 5}\' or '
                        '\'{"frequency_penalty": 0.3}\' (they override the ones above)')
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-server-metrics", action="store_true",
                   help="do not read the server's /metrics before and after the run (its own TTFT and e2e means)")
    p.add_argument("--out", default="bench-out/serve")
    p.set_defaults(func=run)
    return p
