"""The engine process's command pipe (eyas.serve.command_pipe): every command arrives whole and in order, the event
loop never waits for a full pipe, and a closed end is met cleanly on both sides."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.serve.command_pipe import CommandReader, CommandWriter


def _pipe() -> tuple[CommandReader, CommandWriter]:
    r, w = mp.Pipe(duplex=False)
    return CommandReader(r), CommandWriter(w)


def _read_all(reader: CommandReader, n: int, timeout: float = 30.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} commands read"
        try:
            got.append(reader.get(timeout=0.05))
        except queue.Empty:
            pass
    return got


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=12))
def test_commands_from_the_loop_arrive_whole_and_in_order(sizes):
    """Commands of up to 300k token ids (several times a pipe's 64 KiB) put on a running event loop while nobody
    reads: every put returns at once (the rest waits for the loop's writer callback), and a reader that starts
    once the puts are done (or after 2 s, should a put wait for it) gets each command whole, in order."""
    reader, writer = _pipe()
    cmds = [("add", k, [(f"r{k}", list(range(n)), None)]) for k, n in enumerate(sizes)]
    put, got = threading.Event(), []
    late = threading.Thread(target=lambda: (put.wait(2.0), got.extend(_read_all(reader, len(cmds)))))
    late.start()

    async def main():
        writer.attach(asyncio.get_running_loop())
        t0 = time.monotonic()
        for c in cmds:
            writer.put(c)
        put_s = time.monotonic() - t0
        put.set()
        await asyncio.to_thread(late.join, 60)  # the loop runs the writer callback meanwhile
        return put_s

    put_s = asyncio.run(main())
    assert got == cmds
    assert put_s < 1.0  # a put that waited for the pipe waited for the reader's 2 s
    writer.close()
    with pytest.raises(EOFError):
        reader.get(timeout=1.0)


def test_a_put_off_the_loop_waits_for_the_pipe():
    """Off the event loop (an `EngineProcess` closing) a put that overfills the pipe waits until the reader has
    taken it, and nothing is lost."""
    reader, writer = _pipe()
    big = ("add", 0, [("r", list(range(200_000)), None)])
    got = []
    t = threading.Thread(target=lambda: (time.sleep(0.3), got.extend(_read_all(reader, 2))))
    t.start()
    writer.put(big)
    writer.put(("stop",))
    t.join(30)
    assert got == [big, ("stop",)]


def test_a_gone_reader_breaks_the_writer_quietly():
    """The child's end closed (the child died): puts are no-ops (`broken`), on the loop or off it, and never raise;
    the parent learns of the death from its other pipe."""
    reader, writer = _pipe()
    writer.put(("abort", ["a"]))
    assert reader.get(timeout=5.0) == ("abort", ["a"])
    reader.conn.close()
    writer.put(("abort", ["b"]))
    assert writer.broken

    async def on_loop():
        writer.attach(asyncio.get_running_loop())
        writer.put(("add", 1, [("r", list(range(100_000)), None)]))

    asyncio.run(on_loop())
    writer.close()
