"""What the diagnostic tools of tools/diag share: MT-Bench first turns through a model's chat template, rows
printed as JSON lines as they come, then saved with the arguments and the date, a call's median time, and random
sequences for the penalties' tools."""
from __future__ import annotations

import json
import statistics
import time
from types import SimpleNamespace


def chat_prompts(tokenizer, records) -> list[list[int]]:
    """Each record's first user turn (`eyas.bench.tpc.read_prompts`) through the chat template, as token ids."""
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["text"]}]))
            for r in records]


def median_ms(fn, repeat: int, device, setup=None) -> float:
    """The median over `repeat` calls of `fn()`, in ms, synchronised on CUDA; with `setup`, each call is
    `fn(setup())`, the setup untimed (a fresh copy of an input the call changes, say)."""
    import torch
    times = []
    for _ in range(repeat):
        args = () if setup is None else (setup(),)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def random_seqs(rng, batch: int, prompt: int, output: int, vocab: int, params) -> list:
    """`batch` stand-ins of running sequences (what `Penalties.of` and `PenaltyState` read) in slots 0..batch-1:
    `prompt` + `output` random tokens each, under `params`."""
    seqs = []
    for i in range(batch):
        out = [rng.randrange(vocab) for _ in range(output)]
        seqs.append(SimpleNamespace(slot=i, request_id=str(i), params=params, output_ids=out, stop_ids=frozenset(),
                                    token_ids=[rng.randrange(vocab) for _ in range(prompt)] + out))
    return seqs


def emit(rows: list, row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def save(path: str | None, args, rows: list, **extra) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dict(args=vars(args), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **extra,
                           rows=rows), f, indent=1)
