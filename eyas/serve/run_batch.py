"""`eyas run-batch`: a file of OpenAI batch requests answered offline, as vLLM's `run-batch` does.

The input is OpenAI's batch format, one JSON object a line:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "smollm2", ...}}

with `url` one of `URLS`. The output has one line per request, in the input's order:

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "chatcmpl-...",
     "body": {...}}, "error": null}

Each request goes to the server's own app (`create_app`), in this process and without a socket (httpx's ASGI
transport), so a batch line is validated, sampled and answered exactly as the same request sent to `eyas serve`.
Up to `--max-concurrency` requests are in flight at once, so the engine batches them. A request the server refuses
keeps its line: `response` holds the 4xx and the error body, as OpenAI's batch output does. `error` is set only
where no response came back at all.

The whole file is checked before the model loads: a line that is not a JSON object, lacks `custom_id`, repeats one,
names another method or URL, or asks for a stream or a background response stops the command with the line numbers.
Lines are written as soon as every line before them is done, so an interrupted run keeps what it finished.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

log = logging.getLogger("eyas.run_batch")

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
SHOWN_PROBLEMS = 10  # file problems listed in the error, at most


def read_batch(text: str) -> list[dict]:
    """The requests of a batch file's text (blank lines skipped); ValueError naming every problem's line."""
    requests, problems, seen = [], [], {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"line {n}: not JSON ({e.msg})")
            continue
        problem = _line_problem(req, seen)
        if problem:
            problems.append(f"line {n}: {problem}")
            continue
        seen[req["custom_id"]] = n
        requests.append(req)
    if problems:
        more = f"\n  ... and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
        raise ValueError(f"{len(problems)} bad line(s) in the batch file:\n  "
                         + "\n  ".join(problems[:SHOWN_PROBLEMS]) + more)
    if not requests:
        raise ValueError("the batch file holds no requests")
    return requests


def _line_problem(req, seen: dict) -> str | None:
    if not isinstance(req, dict):
        return "a request is a JSON object"
    cid = req.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return "custom_id (a non-empty string) is missing"
    if cid in seen:
        return f"custom_id {cid!r} repeats line {seen[cid]}'s"
    if req.get("method", "POST") != "POST":
        return f"method must be POST, got {req.get('method')!r}"
    if req.get("url") not in URLS:
        return f"url must be one of {', '.join(URLS)}; got {req.get('url')!r}"
    body = req.get("body")
    if not isinstance(body, dict):
        return "body (the request's JSON object) is missing"
    if body.get("stream"):
        return "stream: true is not served in a batch"
    if body.get("background"):
        return "background: true is not served in a batch"
    return None


async def answer_batch(app, requests: list[dict], write, concurrency: int = 64, progress=None) -> dict:
    """Send `requests` (as `read_batch` returns them) to `app` (`create_app`'s), at most `concurrency` at a time, and
    call `write(line)` with each output line (a dict) in the requests' order, as soon as the lines before it are
    written. `progress`: a tqdm bar, advanced per finished request. Returns counts: requests, succeeded, failed (a
    4xx or 5xx, or no response), completion_tokens."""
    import httpx
    if concurrency < 1:
        raise ValueError(f"the concurrency must be >= 1, got {concurrency}")
    done: list[dict | None] = [None] * len(requests)
    counts = dict(requests=len(requests), succeeded=0, failed=0, completion_tokens=0)
    written = 0  # the lines written: the first ones, in order
    gate = asyncio.Semaphore(concurrency)

    def finish(i: int, line: dict) -> None:
        nonlocal written
        done[i] = line
        ok = line["error"] is None and line["response"]["status_code"] == 200
        counts["succeeded" if ok else "failed"] += 1
        if ok:
            usage = line["response"]["body"].get("usage") or {}
            counts["completion_tokens"] += usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
        if progress is not None:
            progress.update(1)
            progress.set_postfix(failed=counts["failed"], tokens=counts["completion_tokens"], refresh=False)
        while written < len(done) and done[written] is not None:
            write(done[written])
            done[written] = {}  # written; nothing kept but the mark
            written += 1

    async def one(i: int, req: dict, client) -> None:
        async with gate:
            line = dict(id=f"batch_req_{uuid.uuid4().hex}", custom_id=req["custom_id"], response=None, error=None)
            try:
                r = await client.post(req["url"], json=req["body"])
                body = r.json()
                line["response"] = dict(status_code=r.status_code, request_id=body.get("id") if isinstance(
                    body, dict) else None, body=body)
            except Exception as e:  # noqa: BLE001 - recorded on the request's line; the others go on
                line["error"] = dict(code="batch_request_failed", message=f"{type(e).__name__}: {e}")
            finish(i, line)

    async with app.router.lifespan_context(app):  # the engine thread starts and stops with it
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://eyas.batch", timeout=None) as client:
            await asyncio.gather(*(one(i, req, client) for i, req in enumerate(requests)))
    return counts


def run_batch(args) -> int:
    from tqdm import tqdm

    from eyas.serve.api_server import _app_options, _capture_graphs, build_llm, create_app
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    try:
        text = Path(args.input_file).read_text()
    except OSError as e:
        raise ValueError(f"--input-file {args.input_file}: {e.strerror or e}") from None
    requests = read_batch(text)  # the file is checked, and the output opened, before the model loads
    options = _app_options(args)
    try:
        out = open(args.output_file, "w")
    except OSError as e:
        raise ValueError(f"--output-file {args.output_file}: {e.strerror or e}") from None
    with out:
        llm = build_llm(args)
        _capture_graphs(llm.engine, args.max_num_seqs, args.capture_extras)
        # no 503s: every request the batch holds back waits at the gate, not in the server's queue
        app = create_app(llm, args.served_model_name or args.model, max_queue=args.max_concurrency, **options)

        def write(line: dict) -> None:
            out.write(json.dumps(line) + "\n")
            out.flush()

        t0 = time.perf_counter()
        with tqdm(total=len(requests), desc="requests", unit="req") as bar:
            counts = asyncio.run(answer_batch(app, requests, write, args.max_concurrency, bar))
        dt = time.perf_counter() - t0
    log.info("%d requests in %.1f s: %d succeeded, %d failed; %d completion tokens (%.1f tokens/s); wrote %s",
             counts["requests"], dt, counts["succeeded"], counts["failed"], counts["completion_tokens"],
             counts["completion_tokens"] / dt if dt > 0 else 0.0, args.output_file)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    from eyas.serve.api_server import add_engine_args
    p = subparsers.add_parser("run-batch", help="answer a file of OpenAI batch requests offline (vLLM's run-batch)",
                              description="Each line of the input is an OpenAI batch request (custom_id, method, "
                                          f"url: {', '.join(URLS)}, body); each line of the output its answer, "
                                          "in the same order (eyas.serve.run_batch)")
    p.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object a line")
    p.add_argument("-o", "--output-file", required=True, help="where the answers go, one JSON object a line")
    p.add_argument("--max-concurrency", type=int, default=256,
                   help="requests in flight at once (the engine runs up to --max-num-seqs of them a step)")
    add_engine_args(p)
    p.set_defaults(func=run_batch)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m eyas.serve.run_batch ...`, the same as `eyas run-batch ...`."""
    from eyas.cli import subcommand_main
    return subcommand_main(add_parser, "run-batch", "eyas.serve.run_batch", argv)


if __name__ == "__main__":
    raise SystemExit(main())
