"""The Python heap of a long-lived engine process, frozen once it is built.

A full (generation 2) collection of CPython's garbage collector scans every tracked object, and a server's heap is
mostly what start-up made and never frees: the model's modules, the tokenizer, the CUDA graphs' bookkeeping, the web
framework (328-348k objects in an engine process, ~227k in its server, on session 70's H100). There, serving 64
streams, the server's full collections took 109-110 ms each and the engine process's 173 ms (a prefill step of
176 ms); the child's messages then waited up to 132-151 ms for the server to read them, and those pauses land in
requests' TTFT and TTIT. `gc.freeze()` moves every object alive into a permanent generation that collections
skip, so later ones scan only what serving allocates: frozen, the server's took 13-18 ms and the engine process made
none, for 9-15% more tokens/s and a TTIT p99 of 1.2-1.9 ms against 2.1-2.7 (`docs/benchmarks.md`, "Session 70";
`tools/diag/serve_steps.py` notes each collection's pause). vLLM freezes its heap after warm-up (`freeze_gc_heap`)
and SGLang offers the same (`freeze_gc`).

`EYAS_GC_FREEZE=0` turns it off (to measure what it buys).
"""
from __future__ import annotations

import atexit
import gc
import logging
import os

log = logging.getLogger("eyas.engine")
_thaw_at_exit: list = []


def freeze_heap(what: str) -> int:
    """Collect what start-up left as garbage, then freeze every object alive (see the module's docstring); returns
    how many objects the permanent generation holds (0 when `EYAS_GC_FREEZE=0`). `what` names the process in the
    log line."""
    if os.environ.get("EYAS_GC_FREEZE", "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    if not _thaw_at_exit:  # frozen objects outlive the interpreter's last collection: native extensions that count
        _thaw_at_exit.append(atexit.register(gc.unfreeze))  # their instances at exit (Triton's) would report leaks
    n = gc.get_freeze_count()
    log.info("%s: %d objects frozen (garbage collections skip them)", what, n)
    return n
