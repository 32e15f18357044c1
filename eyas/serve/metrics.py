"""Prometheus metrics of the server (prometheus-client), on a registry of their own (one per app).

Names follow vLLM's (`vllm:` -> `eyas:`). Everything is updated by the engine loop thread; the gauges after every
engine step and whenever the loop goes idle, so that a scrape of `/metrics` sees the state after the last step.

Several HTTP processes (`eyas serve --api-server-count N`) keep their values in prometheus-client's multiprocess
files (`share_across_processes`, before any metric is made), and a scrape of any of them reads the sum over all:
each server counts its own requests and the engine steps it hears of (each engine message carries what the counts
moved since the last one, to any server), and a gauge reads as the value set last, by any process. TPC is worked
out at the scrape from the summed counters.

| metric | kind | meaning |
| --- | --- | --- |
| eyas:time_to_first_token_seconds | histogram | arrival of a request (its HTTP handler) to its first token |
| eyas:time_per_output_token_seconds | histogram | time between output tokens (TTIT): a step that commits k tokens of a request g seconds after its previous ones counts k tokens of g/k |
| eyas:e2e_request_latency_seconds | histogram | arrival to the last token, finished requests |
| eyas:request_prompt_tokens / eyas:request_generation_tokens | histograms | per finished request |
| eyas:prompt_tokens_total | counter | prompt tokens of requests that got their first token |
| eyas:prefix_cache_queries_total / eyas:prefix_cache_hits_total | counters | the same prompt tokens / those of them the prefix cache held at admission (hit rate: hits / queries) |
| eyas:generation_tokens_total | counter | output tokens |
| eyas:request_success_total{finish_reason} | counter | finished requests: stop, length, abort (a client went away), error |
| eyas:num_requests_running / eyas:num_requests_waiting | gauges | the scheduler's running batch / the waiting queue (+ requests handed in, not yet added) |
| eyas:kv_cache_usage_perc | gauge | used KV blocks / usable blocks, 0..1 |
| eyas:kv_cache_used_blocks / eyas:kv_cache_total_blocks | gauges | the same in blocks |
| eyas:engine_steps_total{kind} | counter | engine steps: prefill, decode |
| eyas:spec_verify_steps_total | counter | speculative decode steps (one target verify forward each), with a draft only |
| eyas:spec_draft_forwards_total | counter | draft forwards (tree depth per speculative step) |
| eyas:spec_target_calls_total | counter | per-request verify calls (one per request per speculative step) |
| eyas:spec_committed_tokens_total | counter | tokens those calls committed |
| eyas:spec_tokens_per_call | gauge | TPC so far: committed / target calls |
| eyas:request_tokens_per_call | histogram | TPC of each finished request |
| eyas:spec_accepted_tokens_by_depth_total{depth} | counter | verify calls whose accepted path reached depth d (1..tree depth) |
| eyas:spec_tree_depth | gauge | the speculation tree's depth (0: speculation off) |
"""
from __future__ import annotations

import bisect
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
TPC_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


_MULTIPROCESS_DIR: str | None = None  # set by `share_across_processes`


def share_across_processes(path: str) -> None:
    """Keep this process's metrics in prometheus-client's multiprocess files under `path` (a directory of this
    server's own, empty at its start), so that every HTTP process of one server scrapes the same sums. Call it
    before any `Metrics` is made; the processes it spawns inherit it."""
    global _MULTIPROCESS_DIR
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    values.ValueClass = values.MultiProcessValue()
    _MULTIPROCESS_DIR = path


class RepeatedHistogram:
    """A histogram (one label value) that takes one value k times in one call: `observe(v, k)`. TTIT counts each of
    the k tokens a step commits to a request at the step's gap / k, and prometheus-client's `Histogram.observe`
    takes one value a call (~0.8 us each, under a lock): k of them per request per step were most of the server
    loop's accounting at large batches. It is prometheus-client's own histogram, whose bucket and sum values this
    adds k and k * v to (the values are what its multiprocess mode keeps in files, so the sums across processes
    hold too)."""

    def __init__(self, name: str, doc: str, label: tuple[str, str], buckets: tuple[float, ...],
                 registry: CollectorRegistry):
        self._child = Histogram(name, doc, [label[0]], buckets=buckets, registry=registry).labels(label[1])
        self.bounds = tuple(float(b) for b in buckets) + (float("inf"),)  # Histogram's own: +Inf last
        assert len(self.bounds) == len(self._child._buckets)

    def observe(self, value: float, count: int = 1) -> None:
        child = self._child
        # the first bound >= value, as Histogram.observe's `value <= bound`: Prometheus's buckets are le
        child._buckets[bisect.bisect_left(self.bounds, value)].inc(count)
        child._sum.inc(value * count)


class _Summed:
    """A scrape of every process's values (prometheus-client's `MultiProcessCollector`), with TPC worked out from the
    summed counters (each process's TPC gauge is its own requests')."""

    def __init__(self, path: str):
        self.collector = MultiProcessCollector(None, path)

    def collect(self):
        families = list(self.collector.collect())
        total = {f.name: sum(s.value for s in f.samples if s.name.endswith("_total")) for f in families
                 if f.name in ("eyas:spec_target_calls", "eyas:spec_committed_tokens")}
        calls = total.get("eyas:spec_target_calls", 0)
        for f in families:
            if f.name == "eyas:spec_tokens_per_call":
                tpc = total.get("eyas:spec_committed_tokens", 0) / calls if calls else 0.0
                f.samples = [s._replace(value=tpc) for s in f.samples]
        return families


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.multiprocess_dir = _MULTIPROCESS_DIR
        lab = ["model_name"]
        self.model_name = model_name

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, lab, registry=r).labels(model_name)

        def gauge(name, doc):  # several processes: the value set last
            return Gauge(name, doc, lab, registry=r, multiprocess_mode="mostrecent").labels(model_name)

        self.ttft = hist("eyas:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.ttit = RepeatedHistogram("eyas:time_per_output_token_seconds",
                                      "Time per output token after the first (TTIT).", ("model_name", model_name),
                                      LATENCY_BUCKETS, r)
        self.e2e = hist("eyas:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.req_prompt_tokens = hist("eyas:request_prompt_tokens", "Prompt tokens per finished request.",
                                      TOKEN_BUCKETS)
        self.req_gen_tokens = hist("eyas:request_generation_tokens", "Output tokens per finished request.",
                                   TOKEN_BUCKETS)
        self.prompt_tokens = counter("eyas:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("eyas:generation_tokens", "Output tokens generated.")
        self.prefix_queries = counter("eyas:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("eyas:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("eyas:num_preemptions", "Requests preempted (recomputed later): for KV blocks, "
                                   "or for higher-priority requests under --scheduling-policy priority.")
        self._success = Counter("eyas:request_success", "Finished requests by finish reason.",
                                lab + ["finish_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)
        self.running = gauge("eyas:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("eyas:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("eyas:kv_cache_usage_perc", "KV-cache usage (used blocks / usable blocks), 0..1.")
        self.kv_used = gauge("eyas:kv_cache_used_blocks", "KV-cache blocks in use.")
        self.kv_total = gauge("eyas:kv_cache_total_blocks", "Usable KV-cache blocks.")
        self._steps = Counter("eyas:engine_steps", "Engine steps by kind.", lab + ["kind"], registry=r)
        self.steps = {k: self._steps.labels(model_name, k) for k in ("prefill", "decode")}
        self.verify_steps = counter("eyas:spec_verify_steps", "Speculative decode steps (target verify forwards).")
        self.draft_forwards = counter("eyas:spec_draft_forwards", "Draft model forwards.")
        self.target_calls = counter("eyas:spec_target_calls", "Per-request verify calls.")
        self.committed = counter("eyas:spec_committed_tokens", "Tokens committed by the per-request verify calls.")
        self.tpc = gauge("eyas:spec_tokens_per_call", "Tokens per target call (TPC) so far.")
        self.req_tpc = hist("eyas:request_tokens_per_call", "TPC of each finished request.", TPC_BUCKETS)
        self._accepted = Counter("eyas:spec_accepted_tokens_by_depth",
                                 "Verify calls whose accepted draft path reached this depth.",
                                 lab + ["depth"], registry=r)
        self.tree_depth = gauge("eyas:spec_tree_depth", "Depth of the speculation tree (0: speculation off).")
        self._tree_steps = Counter("eyas:spec_decode_steps_by_tree",
                                   "Decode steps by the speculation tree they ran (a dispatcher picks it by batch "
                                   "size and temperature; chain:0 is a plain step, plain one without the draft).",
                                   lab + ["tree"], registry=r)
        self._depth_children: dict[int, Counter] = {}
        self._calls_total = 0
        self._committed_total = 0

    def set_tree_depth(self, depth: int) -> None:
        self.tree_depth.set(depth)
        for d in range(1, depth + 1):
            self.accepted(d)

    def accepted(self, depth: int):
        c = self._depth_children.get(depth)
        if c is None:
            c = self._depth_children[depth] = self._accepted.labels(self.model_name, str(depth))
        return c

    def tree_steps(self, tree: str):
        return self._tree_steps.labels(self.model_name, tree)

    def finished(self, reason: str):
        return self._success.labels(self.model_name, reason)

    def add_spec(self, calls: int, committed: int) -> None:
        if calls <= 0:
            return
        self.target_calls.inc(calls)
        self.committed.inc(committed)
        self._calls_total += calls
        self._committed_total += committed
        self.tpc.set(self._committed_total / self._calls_total)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        summed = CollectorRegistry()
        summed.register(_Summed(self.multiprocess_dir))
        return generate_latest(summed)
