"""A stub of an OpenAI-compatible streaming server, to time `eyas bench serve`'s client alone: every POST streams
`--tokens` chat chunks of one "x" each (whatever it asks), one per `--step-ms` (a decode step), then the usage
chunk and `data: [DONE]`, with no model and no engine behind it (`--hold-ms`: the body ends that long after
`[DONE]`). `GET /peak` answers the most requests it held at once since the last `/peak` (what concurrency the
client really reached) and, since session 72, the stamped requests' ms from the client's send to this handler
(`arrival_ms`: count, mean, p50, p90, p99, max; `eyas bench serve` stamps each); `/metrics` is absent, as on a peer
without metrics.

    python tools/diag/sse_stub.py --port 8741 --tokens 16 --step-ms 2 &
    eyas bench serve --base-url http://127.0.0.1:8741/v1 --model stub --num-prompts 2000 --max-tokens 16 \\
        --concurrency 64 --no-progress --out /tmp/stub
    curl -s http://127.0.0.1:8741/peak

Session 71 measured the client's kept-alive connections with it (`docs/benchmarks.md`, "Session 71").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from eyas.bench.serve import SENT_HEADER, _stats

SENT = SENT_HEADER.encode()  # the client's send on this machine's monotonic clock


class Stub:
    def __init__(self, tokens: int, step_s: float, hold_s: float = 0.0):
        self.tokens, self.step_s, self.hold_s = tokens, step_s, hold_s
        self.inflight = self.peak = 0
        self.arrivals: list[float] = []  # s from each stamped request's send to this handler, since the last /peak

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                done = message["type"] == "lifespan.shutdown"
                await send({"type": message["type"] + ".complete"})
                if done:
                    return
        if scope["path"] == "/peak":
            peak = {"peak": self.peak, "arrival_ms": arrivals(self.arrivals)}
            await self._whole(send, 200, json.dumps(peak).encode())
            self.peak, self.arrivals = self.inflight, []
            return
        if scope["method"] != "POST":
            await self._whole(send, 404, b"")
            return
        sent = dict(scope["headers"]).get(SENT)
        if sent is not None:
            self.arrivals.append(time.monotonic() - float(sent))
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for _ in range(self.tokens):
                await asyncio.sleep(self.step_s)
                chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                            "more_body": True})
            usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": self.tokens,
                                              "total_tokens": 1 + self.tokens}}
            tail = f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": tail, "more_body": True})
            try:  # a server that keeps the stream open past [DONE], until the client goes away
                await asyncio.wait_for(receive(), self.hold_s)
            except asyncio.TimeoutError:
                pass
            await send({"type": "http.response.body", "body": b""})
        finally:
            self.inflight -= 1

    @staticmethod
    async def _whole(send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def arrivals(seconds: list[float]) -> dict | None:
    """The arrivals' count, then their mean and percentiles and max in ms (as `eyas bench serve` states its
    latencies); None when none came."""
    return {"count": len(seconds), **_stats(seconds), "max": 1000 * max(seconds)} if seconds else None


def main() -> None:
    import uvicorn
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8741)
    p.add_argument("--tokens", type=int, default=16, help="chunks a request streams")
    p.add_argument("--step-ms", type=float, default=2.0, help="the wait before each chunk")
    p.add_argument("--hold-ms", type=float, default=0.0, help="the wait after [DONE] before the body ends")
    args = p.parse_args()
    uvicorn.run(Stub(args.tokens, args.step_ms / 1000.0, args.hold_ms / 1000.0), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
