"""`eyas bench serve`: what the clients of an OpenAI-compatible server see, under load. The same requests go to any
server that streams `/v1/chat/completions` or `/v1/completions` (`eyas serve`, vLLM's, SGLang's), so peers are
compared on equal terms. The client is httpx with the events parsed by hand (the openai package's client took ~20%
more CPU a streamed chunk, ~0.13 ms, which on a small machine set the pace instead of the server); the summary says
how busy it kept a core (`client_busy`), and a note warns above 80%.

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


async def _stream_request(client, url: str, body: dict, on_text, finished=None) -> int | None:
    """POST one streamed request and read its server-sent events: `on_text(piece)` for each text, `finished[0]` :=
    the choice's finish reason (when given a list), and the output token count of the usage chunk (None if none
    came). Raises RuntimeError with the server's message on an HTTP error or an error event."""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raw = (await r.aread()).decode(errors="replace")
            try:
                raw = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise RuntimeError(f"HTTP {r.status_code}: {raw}")
        tokens = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event: {event['error'].get('message')}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for c in event.get("choices", ()):
                piece = c["delta"].get("content") if "delta" in c else c.get("text")
                if piece:
                    on_text(piece)
                if finished is not None and c.get("finish_reason"):
                    finished[0] = c["finish_reason"]
        return tokens


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


async def _one(client, args, prompt: str, start_at: float, t0: float, gate: asyncio.Semaphore,
               guided=None) -> dict:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
            "stream": True, "stream_options": {"include_usage": True}}
    if guided is not None:
        body.update(guided_fields(guided, args.endpoint == "chat"))
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"], path = [{"role": "user", "content": prompt}], "/chat/completions"
    else:
        body["prompt"], path = prompt, "/completions"
    first = last = None  # when the first and the latest text arrived
    chars = 0
    pieces = [] if guided is not None else None  # a guided output's text, checked against its guide at the end

    def on_text(piece: str) -> None:
        nonlocal first, last, chars
        last = time.perf_counter()
        first = first or last
        chars += len(piece)
        if pieces is not None:
            pieces.append(piece)

    async with gate:
        start = time.perf_counter()
        tokens, error, finished = None, None, [None]
        try:
            tokens = await _stream_request(client, args.base_url.rstrip("/") + path, body, on_text, finished)
        except Exception as e:  # the server's error or the connection's: counted, never lost
            error = f"{type(e).__name__}: {e}"
        end = time.perf_counter()
    if error is None and tokens is None:
        error = "the stream ended without a usage chunk (stream_options.include_usage)"
    row = {"start_s": start - t0, "e2e_s": end - start, "output_tokens": tokens, "error": error,
           "ttft_s": None if first is None else first - start, "ttit_s": None, "chars": chars,
           "finish_reason": finished[0]}
    if error is None and first is not None and tokens and tokens > 1:
        row["ttit_s"] = (last - first) / (tokens - 1)
    if guided is not None:
        from eyas.bench.tpc import matches_guide
        row["guided"] = guided.kind
        row["guided_valid"] = error is None and finished[0] == "stop" and matches_guide(guided, "".join(pieces))
    return row


async def _run(args, prompts: list[str], guides: list | None = None) -> tuple[list[dict], float, float]:
    import httpx
    from tqdm import tqdm
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers) as client:
        gate = asyncio.Semaphore(args.concurrency)
        starts = request_starts(len(prompts), args.request_rate, args.seed)
        t0, cpu0 = time.perf_counter(), time.process_time()
        guides = guides or [None] * len(prompts)
        tasks = [asyncio.ensure_future(_one(client, args, p, s, t0, gate, g))
                 for p, s, g in zip(prompts, starts, guides)]
        rows = []
        with tqdm(total=len(tasks), desc="requests", disable=args.no_progress) as bar:
            for fut in asyncio.as_completed(tasks):
                rows.append(await fut)
                bar.update(1)
        duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rows.sort(key=lambda r: r["start_s"])
    return rows, duration, cpu


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def summarize(rows: list[dict], duration: float, client_cpu: float = 0.0) -> dict:
    """Over the run: counts, rates from the first start to the last end, each latency's mean and percentiles in ms
    (TTIT over the requests with at least two output tokens), and the share of the run the client itself kept a
    core busy (`client_busy`: its process's CPU time over the run's)."""
    ok = [r for r in rows if r["error"] is None]
    tokens = sum(r["output_tokens"] for r in ok)
    return {"requests": len(rows), "completed": len(ok), "failed": len(rows) - len(ok),
            "duration_s": duration, "requests_per_s": len(ok) / duration, "output_tokens": tokens,
            "output_tokens_per_s": tokens / duration, "client_cpu_s": client_cpu, "client_busy": client_cpu / duration,
            "guided": sum("guided" in r for r in rows), "guided_valid": sum(bool(r.get("guided_valid")) for r in rows),
            "ttft_ms": _stats([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
            "ttit_ms": _stats([r["ttit_s"] for r in ok if r["ttit_s"] is not None]),
            "e2e_ms": _stats([r["e2e_s"] for r in ok])}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def markdown(runs: list[dict]) -> str:
    head = ("| run | requests (failed) | concurrency | rate /s | output tokens/s | TTFT mean / p50 / p99 ms | "
            "TTIT mean / p50 / p99 ms | e2e p50 / p99 ms |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        s, m = run["summary"], run["meta"]
        t, i, e = s["ttft_ms"], s["ttit_ms"], s["e2e_ms"]
        lines.append(f"| {m['label']} | {s['requests']} ({s['failed']}) | {m['concurrency']} | {m['request_rate']} | "
                     f"{s['output_tokens_per_s']:.1f} | {_fmt(t['mean'])} / {_fmt(t['p50'])} / {_fmt(t['p99'])} | "
                     f"{_fmt(i['mean'])} / {_fmt(i['p50'])} / {_fmt(i['p99'])} | {_fmt(e['p50'])} / "
                     f"{_fmt(e['p99'])} |")
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
    if args.concurrency < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--concurrency, --num-prompts and --max-tokens must be at least 1")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    earlier = read_runs(args.compare)  # a bad file fails before the load
    records = read_prompts(args.prompts)
    chosen = [records[i % len(records)] for i in range(args.num_prompts)]  # cycled past the file's end
    guides = [r["guided"] if args.guided else None for r in chosen]
    rows, duration, cpu = asyncio.run(_run(args, [r["text"] for r in chosen], guides))
    meta = {"label": args.label or args.base_url, "base_url": args.base_url, "model": args.model,
            "endpoint": args.endpoint, "prompts": str(args.prompts), "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
            "concurrency": args.concurrency, "request_rate": args.request_rate, "seed": args.seed,
            "guided": sum(g is not None for g in guides),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    result = {"meta": meta, "summary": summarize(rows, duration, cpu), "requests": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(result, indent=2))
    runs = earlier + [result]
    (out / "serve.md").write_text(markdown(runs))
    plot(runs, out / "serve.png")
    print(markdown(runs), end="")
    if result["summary"]["client_busy"] > BUSY_WARNING:
        print(f"note: this client kept a core {100 * result['summary']['client_busy']:.0f}% busy: it may have limited "
              "the rates; run it on cores the server does not use (taskset), or on another machine")
    s = result["summary"]
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
    p.add_argument("--num-prompts", type=int, default=80, help="requests (the prompts cycled past the file's end)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="every request takes --max-tokens (a vLLM extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="the requests' sampling seed and the arrivals' seed")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson), or inf")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--label", default=None, help="this run's name in the table and plot (default: the URL)")
    p.add_argument("--compare", nargs="*", default=[], help="earlier serve.json files to show beside this run")
    p.add_argument("--no-guided", dest="guided", action="store_false",
                   help="send prompts with a guide (json_schema, regex, ...) free: the same prompts unconstrained")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="bench-out/serve")
    p.set_defaults(func=run)
    return p
