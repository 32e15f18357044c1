"""The parent's commands to its engine process (`eyas.serve.core_client`, `eyas.serve.engine_core`), on a pipe and
with no thread.

`CommandWriter`, the parent's end, pickles and writes each command on the thread that puts it (the event loop's).
What the pipe cannot take at once waits in a buffer, written when the pipe is writable again (`loop.add_writer`),
so the event loop never blocks on a full pipe; off the loop (closing), a put waits for the pipe. `CommandReader`,
the child's end, reads whole commands between two steps, with `queue.Queue`'s `get` and `get_nowait`.

A `multiprocessing` queue did this before session 72. Its feeder thread woke for every command and then took the GIL
from the event loop. On a GPU at 64 streams, a command waited 3.6 ms (median) from the put to the child's take.
Each frame is a length (8 bytes, little-endian) and then the pickle (`ForkingPickler`, as the queue's).
"""
from __future__ import annotations

import asyncio
import collections
import os
import pickle
import queue
import select
import struct
import threading
from multiprocessing.reduction import ForkingPickler

HEADER = struct.Struct("<Q")
READ_SIZE = 1 << 20  # bytes read at once at most
CLOSE_WAIT_S = 5.0  # how long a put off the loop waits for a pipe that takes nothing


class CommandWriter:
    """The parent's end of the command pipe (`conn`: the write end of `multiprocessing.Pipe(duplex=False)`). `put`
    never blocks the event loop given to `attach`. A child that is gone (its end closed) makes every put a no-op
    (`broken`): the parent learns it from the other pipe."""

    def __init__(self, conn):
        self.conn = conn
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self._buf = bytearray()  # framed commands not yet written, in order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting = False  # a writer callback is registered on the loop
        self._lock = threading.Lock()
        self.broken = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Puts on `loop`'s thread leave what the pipe cannot take to a writer callback on `loop`."""
        self._loop = loop

    def put(self, cmd) -> None:
        data = ForkingPickler.dumps(cmd)
        with self._lock:
            if self.broken:
                return
            self._buf += HEADER.pack(len(data))
            self._buf += data
            self._write()
            if not self._buf:
                return
            if self._on_loop():
                if not self._waiting:
                    self._loop.add_writer(self.fd, self._writable)
                    self._waiting = True
            else:
                self._drain()

    def _on_loop(self) -> bool:
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        try:
            return asyncio.get_running_loop() is loop
        except RuntimeError:
            return False

    def _write(self) -> None:
        """As much of the buffer as the pipe takes now."""
        try:
            while self._buf:
                n = os.write(self.fd, self._buf)
                del self._buf[:n]
        except BlockingIOError:
            pass
        except OSError:  # the child's end is closed: it is gone
            self.broken = True
            self._buf.clear()

    def _writable(self) -> None:
        with self._lock:
            self._write()
            if not self._buf:
                self._loop.remove_writer(self.fd)
                self._waiting = False

    def _drain(self) -> None:
        """Off the loop: wait for the pipe until the buffer is written (at most `CLOSE_WAIT_S` without progress)."""
        while self._buf:
            _, ready, _ = select.select([], [self.fd], [], CLOSE_WAIT_S)
            if not ready:
                raise TimeoutError(f"the engine process took no command for {CLOSE_WAIT_S:.0f} s")
            self._write()

    def close(self) -> None:
        with self._lock:
            if self._waiting and not self._loop.is_closed():
                self._loop.remove_writer(self.fd)
            self._waiting = False
            self._buf.clear()
            self.conn.close()


class CommandReader:
    """The child's end of the command pipe (`conn`: the read end). `get(timeout)` and `get_nowait()` as a
    `queue.Queue`'s (`queue.Empty` when no whole command came in time); EOFError once the parent's end is closed and
    every command was read."""

    def __init__(self, conn):
        self.conn = conn
        self.fd = conn.fileno()
        self._buf = bytearray()
        self._cmds: collections.deque = collections.deque()
        self._eof = False

    def get(self, timeout: float | None = None):
        if not self._cmds:
            if not self._eof:
                self._read(timeout)
            if not self._cmds:
                if self._eof:
                    raise EOFError("the parent closed the command pipe")
                raise queue.Empty
        return self._cmds.popleft()

    def get_nowait(self):
        return self.get(0)

    def _read(self, timeout: float | None) -> None:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        while ready:
            chunk = os.read(self.fd, READ_SIZE)
            if not chunk:
                self._eof = True
                break
            self._buf += chunk
            ready, _, _ = select.select([self.fd], [], [], 0)
        buf, at = self._buf, 0
        while len(buf) - at >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, at)
            if len(buf) - at - HEADER.size < n:
                break
            self._cmds.append(pickle.loads(buf[at + HEADER.size:at + HEADER.size + n]))
            at += HEADER.size + n
        del buf[:at]
