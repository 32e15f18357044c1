"""The Python heap of a long-lived engine process, frozen once it is built.

A full (generation 2) collection of CPython's garbage collector scans every tracked object, and a server's heap is
mostly what start-up made and never frees: the model's modules, the tokenizer, the CUDA graphs' bookkeeping, the web
framework (~330k objects in an engine process, ~220k in its server). On this repository's CPU one such collection
took 115-150 ms (`tools/diag/serve_steps.py`, which notes each collection's pause). Session 70's H100 servers showed
stalls of that size: a 178 ms prefill step in which the engine loop's thread used 2.5 ms of CPU (waiting for the
GIL), an engine process's 136 ms decode step that was all CPU, messages that waited up to ~120 ms for the server to
read them; they land in some requests' TTFT and TTIT. `gc.freeze()` moves every object alive into a permanent
generation that collections skip, so later ones scan only what serving itself allocates. vLLM freezes its heap
after warm-up (`freeze_gc_heap`) and SGLang offers the same (`freeze_gc`).

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
