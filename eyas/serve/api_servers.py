"""Several HTTP processes in front of one engine process: `eyas serve --api-server-count N` (vLLM's option).

With the engine in a process of its own (`eyas.serve.engine_core`), the HTTP side is one process, one event loop
thread: parsing requests, tokenizing prompts, every stream's chunks. Session 72 measured that process 75-90% busy
of one core at 64 and 128 streams on an H100 (docs/serving.md), so it set the pace there. Here N processes share
the listening socket (bound once, before the model loads; the kernel hands each new connection to one of them) and
the engine:

* this process starts the engine process with N clients (`EngineProcess(clients=N)`), spawns servers 1..N-1, each
  with the socket and its `EngineLink`, and serves as server 0 itself;
* every server builds the same app (`create_app`) with the same options; the metrics of all of them are summed at
  every scrape (`eyas.serve.metrics.share_across_processes`);
* Ctrl-C reaches every process and each shuts down as one server does; SIGTERM to this process stops the others
  (each finishes what it serves, `STOP_TIMEOUT_S` at most) before the engine stops. A server that dies while
  serving stops the whole command (exit status 1): its clients' connections broke, and a supervisor should start it
  again whole. The engine aborts the dead server's requests and frees their blocks.

What each process keeps for itself: `/v1/responses`' stored responses (a GET or a `previous_response_id` finds
only those its own process made; `store: false` has no such limit) and its admission limit: each server takes up
to `--max-num-seqs` + `--max-queue` requests.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import threading

import torch.multiprocessing as mp

log = logging.getLogger("eyas.serve")

STOP_TIMEOUT_S = 30.0  # a server's graceful shutdown (its streams finish) before it is killed


def check_api_server_count(args) -> int:
    """--api-server-count, checked before anything loads; with more than one, the engine process is on (ValueError
    where an option rules it out)."""
    n = getattr(args, "api_server_count", 1)
    if n < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {n}")
    if n == 1:
        return n
    if getattr(args, "engine_process", None) is False:
        raise ValueError("--api-server-count > 1 shares an engine process among the HTTP processes: it does not "
                         "combine with --no-engine-process")
    for flag in ("tensor_parallel", "disaggregate", "prefill_process"):
        value = getattr(args, flag, None)
        if value and not (flag == "tensor_parallel" and value == 1):
            raise ValueError(f"--api-server-count > 1 does not combine with --{flag.replace('_', '-')} yet")
    args.engine_process = True
    return n


def serve_shared(args, options: dict, sock: socket.socket) -> int:
    """`eyas serve` with `args.api_server_count` HTTP processes (see the module's docstring); `sock`: the bound
    listening socket. Returns the exit status: 1 when a server died while serving."""
    from eyas.serve.api_server import serve_app, start_engine_process
    from eyas.serve.metrics import share_across_processes
    n = args.api_server_count
    metrics_dir = tempfile.mkdtemp(prefix="eyas-metrics-")
    share_across_processes(metrics_dir)  # before any metric is made here; the servers spawned inherit it
    try:
        llm = start_engine_process(args, clients=n)
    except BaseException:
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        raise
    ctx = mp.get_context("spawn")
    servers = [ctx.Process(target=api_server_main, args=(i, sock, llm.link_parts(i), args, options, metrics_dir),
                           name=f"eyas-api-server-{i}", daemon=True) for i in range(1, n)]
    stopping, died = threading.Event(), []

    def stop_servers():  # before the engine stops (`EngineProcess.on_close`): each finishes what it serves
        stopping.set()
        for p in servers:  # SIGTERM: each shuts down as one server does (it may have had Ctrl-C already)
            if p.is_alive():
                p.terminate()
        for p in servers:
            p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(5)

    llm.on_close.append(stop_servers)
    try:
        for p in servers:
            p.start()
        llm.close_links()
        threading.Thread(target=_watch, args=(servers, stopping, died), name="eyas-api-servers-watch",
                         daemon=True).start()
        log.info("%d HTTP processes share the engine process (--api-server-count)", n)
        serve_app(llm, args, options, sock)
    finally:
        llm.close()  # stop_servers first (the app's shutdown has done both already, unless it did not start)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if died else 0


def _watch(servers: list, stopping: threading.Event, died: list) -> None:
    """Stop the whole command (SIGTERM to this process) when a server ends while it serves with an exit code but 0
    (a server that stopped on a signal of its own, as Ctrl-C to the process group gives, is no failure)."""
    from multiprocessing.connection import wait
    left = list(servers)
    while left:
        ready = wait([p.sentinel for p in left])
        ended = [p for p in left if p.sentinel in ready]
        if stopping.is_set():
            return
        for p in ended:  # its sentinel closes as it exits, its exit code comes once it is reaped
            p.join(5)
        failed = [p for p in ended if p.exitcode != 0]
        if failed:
            died.extend(p.name for p in failed)
            log.critical("%s ended while serving (exit code %s): stopping the server",
                         ", ".join(p.name for p in failed), ", ".join(str(p.exitcode) for p in failed))
            os.kill(os.getpid(), signal.SIGTERM)
            return
        log.info("%s stopped", ", ".join(p.name for p in ended))
        left = [p for p in left if p not in ended]


def api_server_main(index: int, sock: socket.socket, parts: tuple, args, options: dict, metrics_dir: str) -> None:
    """HTTP process `index` (1..N-1): the app on the shared socket, client `index` of the engine process."""
    from eyas.serve.api_server import serve_app
    from eyas.serve.core_client import EngineLink
    from eyas.serve.metrics import share_across_processes
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s (api server {index}): %(message)s")
    share_across_processes(metrics_dir)
    serve_app(EngineLink(*parts), args, options, sock, announce=False)
