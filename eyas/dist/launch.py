"""Process-group setup and teardown for tensor parallelism, and a `spawn` helper.

* `init_distributed()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT);
  `init_distributed(rank, world_size, init_method)` takes them explicitly. The backend is NCCL when CUDA is present
  (rank -> cuda:LOCAL_RANK) and gloo on the CPU.
* `shutdown()` never leaves a rank waiting forever: a barrier bounded by a timeout, then `destroy_process_group` in a
  daemon thread joined with a timeout (torchrun processes were seen hanging in `destroy_process_group()` with NCCL).
  If either times out, it warns and returns; the caller may then `os._exit`.
* `spawn(fn, world_size, *args)` starts `world_size` processes, each running `fn(rank, world_size, device, *args)`
  between `init_distributed` and `shutdown`, and kills them all if they do not finish within `timeout`.
* `run_ranks(fn, world_size, *args)`: what the commands call. Started by torchrun (its WORLD_SIZE in the
  environment), this process is one rank already: it joins the group and runs `fn` itself; otherwise `spawn`.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int | None = None, world_size: int | None = None, init_method: str | None = None,
                     backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int, torch.device]:
    """Join the process group; returns (rank, world_size, device). Without arguments, torchrun's environment."""
    env = os.environ
    rank = int(env.get("RANK", 0)) if rank is None else rank
    world_size = int(env.get("WORLD_SIZE", 1)) if world_size is None else world_size
    local_rank = int(env.get("LOCAL_RANK", rank))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if init_method is None and "MASTER_ADDR" not in env:
        raise ValueError("no init_method and no MASTER_ADDR/MASTER_PORT in the environment (start with torchrun, "
                         "or pass init_method='tcp://127.0.0.1:PORT')")
    kwargs = dict(backend=backend, rank=rank, world_size=world_size, init_method=init_method or "env://",
                  timeout=datetime.timedelta(seconds=timeout_s))
    if backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL communicator: created before any CUDA graph capture
    dist.init_process_group(**kwargs)
    return rank, world_size, device


def shutdown(timeout_s: float = 30.0, destroy_timeout_s: float = 5.0) -> bool:
    """Leave the process group without hanging: returns True if the barrier and the teardown both finished in time.

    The barrier is bounded (gloo: `monitored_barrier`; NCCL: an async barrier polled until the deadline); a rank
    whose peers died or are stuck warns and goes on. `destroy_process_group` runs in a daemon thread joined with a
    timeout, so a teardown stuck in the communicator cannot keep the rank alive."""
    if not dist.is_available() or not dist.is_initialized():
        return True
    ok = True
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        else:
            work = dist.barrier(async_op=True)
            deadline = time.monotonic() + timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"barrier not reached by every rank within {timeout_s} s")
                time.sleep(0.005)
    except Exception as e:  # a peer died or is stuck: do not wait for it
        warnings.warn(f"eyas.dist.shutdown: barrier failed ({e}); tearing down anyway")
        ok = False
    t = threading.Thread(target=_destroy, daemon=True)
    t.start()
    t.join(destroy_timeout_s)  # on the H200 x2 machine NCCL's teardown never returned (session 9: 30 s every run)
    if t.is_alive():
        warnings.warn(f"eyas.dist.shutdown: destroy_process_group did not return within {destroy_timeout_s} s; "
                      "leaving it behind (exit with os._exit if the process must end now)")
        ok = False
    return ok


def _destroy() -> None:
    try:
        dist.destroy_process_group()
    except Exception:  # already torn down, or the peer is gone
        pass


def _worker(rank: int, fn, world_size: int, init_method: str, backend: str | None, threads: int | None,
            args: tuple) -> None:
    if threads:
        torch.set_num_threads(threads)
    _, _, device = init_distributed(rank, world_size, init_method, backend)
    try:
        fn(rank, world_size, device, *args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # skip the barrier: the other ranks' timeout (or spawn's kill) ends them
    ok = shutdown()
    if not ok:
        os._exit(0)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def spawn(fn, world_size: int, *args, backend: str | None = None, timeout: float = 600.0,
          threads: int | None = None, grace_s: float = 30.0) -> None:
    """Run `fn(rank, world_size, device, *args)` on `world_size` fresh processes (`fn` must be importable: a module-level
    function of a real module). Rendezvous on 127.0.0.1 and a free port. Raises if a rank fails; kills every rank and
    raises TimeoutError if they are not all done within `timeout` seconds (`float("inf")`: a server, no limit).

    Interrupted (Ctrl-C, or SIGTERM, which it turns into KeyboardInterrupt while it waits), it sends SIGTERM to
    rank 0 alone, which drives the others (a server shuts down and stops them), waits up to `grace_s` seconds for
    every rank to end, kills what is left and raises KeyboardInterrupt."""
    import signal
    import threading as _threading
    import torch.multiprocessing as mp
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.start_processes(_worker, args=(fn, world_size, init_method, backend, threads, args), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    main = _threading.current_thread() is _threading.main_thread()
    old = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks still running after {timeout} s: killed")
    except KeyboardInterrupt:
        if ctx.processes[0].is_alive():
            ctx.processes[0].terminate()
        end = time.monotonic() + grace_s
        for p in ctx.processes:
            p.join(max(0.0, end - time.monotonic()))
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def run_ranks(fn, world_size: int, *args, on_gpu: bool, timeout: float = 600.0) -> None:
    """Run `fn(rank, world_size, device, *args)` on every rank: in this process when torchrun started it (one rank
    of its WORLD_SIZE, which must equal `world_size`), else on `world_size` processes of `spawn`. `on_gpu`: one GPU
    a rank and NCCL (ValueError if there are fewer GPUs than ranks); else gloo on the CPU, one thread a rank (more
    oversubscribe the cores against gloo's waits)."""
    if on_gpu and torch.cuda.device_count() < world_size:
        raise ValueError(f"--tensor-parallel {world_size} needs {world_size} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    backend, threads = (None, None) if on_gpu else ("gloo", 1)
    if under_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            raise ValueError(f"--tensor-parallel {world_size}, but torchrun started {env_world} processes "
                             "(--nproc-per-node must equal it)")
        if threads:
            torch.set_num_threads(threads)
        rank, world, device = init_distributed(backend=backend)
        try:
            fn(rank, world, device, *args)
        finally:
            shutdown()
        return
    spawn(fn, world_size, *args, backend=backend, timeout=timeout, threads=threads)
