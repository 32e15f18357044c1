"""The Python heap of a long-lived engine process, frozen once it is built.

A full (generation 2) collection of CPython's garbage collector scans every tracked object, and a server's heap is
mostly what start-up made and never frees: the model's modules, the tokenizer, the CUDA graphs' bookkeeping, the web
framework. On session 70's H100 such collections stopped a serving process for 100-180 ms at a time (the engine
loop's thread waiting for the GIL through a 178 ms prefill step that used 2.5 ms of CPU; an engine process's decode
step of 136 ms, all of it CPU), which lands in some requests' TTFT and TTIT. `gc.freeze()` moves every object alive
into a permanent generation that collections skip, so later ones scan only what serving itself allocates. vLLM
freezes its heap after warm-up (`freeze_gc_heap`) and SGLang offers the same (`freeze_gc`).

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
