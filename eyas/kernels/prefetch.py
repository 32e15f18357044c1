"""An L2 prefetch that a kernel issues for the next kernel's weight (issue #5, point 1).

At batch 1 a wide model's decode layer leaves HBM idle while its attention runs (the 8B shape: ~9 us a layer of
attention and split reduction, which read 4 MB), and the o projection after it streams 33.5 MB. The register
kernel (`eyas.kernels.decode_linear`) reads an L2-resident weight much faster than one in HBM (H200, session 45,
`docs/benchmarks.md`: the 8B o projection 6.0 us against 9.4 back to back on the same or on distinct weights, PDL
on), and the H200's L2 (60 MB) holds that weight. So the prefix attention's programs may first ask for a slice of
the o weight each (`prefetch.global.L2` per 128-byte line, before their PDL wait: the weight does not depend on
earlier kernels), and the o projection finds it in L2.

Session 10 found an L2 prefetch from a side stream worthless for cuBLAS's GEMVs (`tools/diag/l2_prefetch_bench.py`);
this is the other mechanism: issued inside the kernel that runs while HBM idles, for a GEMV that gains from L2.

A prefetch changes no value: the kernels compute the same with or without it. Under TRITON_INTERPRET (no PTX) it
is skipped (`prefetch_lines` gives 0)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import interpreting

LINE = 128  # bytes an L2 prefetch instruction asks for


@triton.jit
def l2_prefetch(P, nbytes, pid, LINES: tl.constexpr):
    """Program `pid`'s share of the prefetch of the first `nbytes` bytes at P (a uint8 pointer): lines pid * LINES
    .. (pid + 1) * LINES - 1 of 128 bytes; lines past the end ask for line 0 again (harmless). LINES 0: nothing."""
    if LINES > 0:
        offs = (pid.to(tl.int64) * LINES + tl.arange(0, LINES)) * 128
        ptrs = P + tl.where(offs < nbytes, offs, 0)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


def lines_per_program(nbytes: int, programs: int) -> int:
    """LINES for `l2_prefetch`: a power of two, so that `programs` programs cover all `nbytes` bytes."""
    return triton.next_power_of_2(max(1, triton.cdiv(triton.cdiv(nbytes, LINE), max(1, programs))))


def prefetch_lines(t: torch.Tensor | None, programs: int) -> tuple[torch.Tensor | None, int, int]:
    """(the bytes of `t` as a uint8 tensor, their count, LINES for `l2_prefetch`) when `programs` programs share the
    prefetch of all of the contiguous CUDA tensor `t`; (None, 0, 0) without one (or under the interpreter)."""
    if t is None or interpreting() or t.device.type != "cuda" or programs <= 0:
        return None, 0, 0
    if not t.is_contiguous():
        raise ValueError("an L2 prefetch needs a contiguous tensor")
    nbytes = t.numel() * t.element_size()
    return t.view(-1).view(torch.uint8), nbytes, lines_per_program(nbytes, programs)
