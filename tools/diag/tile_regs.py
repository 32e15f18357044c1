"""Registers and spills of the tile kernels at SmolLM2's verify-pass shapes, compiled offline for sm_90 (no GPU:
the ptxas and cuobjdump inside the triton wheel, `tests/helpers.compile_for_sm90`). For choosing the configs a
device sweep tries: a whole-K tile that spills (local memory) is slow however it is launched.

    PYTHONPATH=.:tests python3 tools/diag/tile_regs.py --rows 16,49 --configs 16x0x4x1x16,16x0x8x1x32

Each row: kind (qkv_rope: RoPE pairs into a stash; gu: SwiGLU pairs with the norm; o and down: residual), rows,
config (BLOCK_NxBLOCK_KxWARPSxSTAGES[xBLOCK_M], BLOCK_K 0 = whole K), registers a thread, stack bytes a thread
(ptxas's spills; 0 is what we want), dynamic shared memory (bytes a program).
"""
from __future__ import annotations

import argparse
import re
import sys

import torch

from eyas.kernels.decode_linear import TileConfig
from helpers import SMOLLM2_TILE_SHAPES as SHAPES, compile_for_sm90, tile_variant  # tests/ on the path


def variant(kind: str, M: int, cfg: TileConfig):
    """(module, kernel name, signature, constexprs, options) for `compile_for_sm90`: the kernel and constexprs that
    decode_linear's own launch takes, bf16, with PDL (`helpers.tile_variant`)."""
    return tile_variant(M, cfg, torch.bfloat16, **SHAPES[kind])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default=",".join(SHAPES))
    ap.add_argument("--rows", default="16,49")
    ap.add_argument("--configs", default="16x0x4x1x16,16x0x8x1x16,32x0x4x1x16,32x0x8x1x16,16x0x4x1x32,"
                                         "16x0x8x1x32,64x0x4x1x32,64x0x8x1x32,64x0x4x1x16")
    args = ap.parse_args(argv)
    todo = []
    for kind in args.kinds.split(","):
        for M in (int(m) for m in args.rows.split(",")):
            for c in args.configs.split(","):
                cfg = TileConfig(*(int(v) for v in c.split("x")))
                if SHAPES[kind]["pair"] and cfg.BLOCK_N < 32:
                    continue
                todo.append((kind, M, c, variant(kind, M, cfg)))
    results = compile_for_sm90([t[3] for t in todo])
    for (kind, M, c, _), r in zip(todo, results):
        if r["error"]:
            print(kind, M, c, "error:", r["error"][-200:])
            continue
        u = r["usage"] or ""
        reg = re.search(r"REG:(\d+)", u)
        lmem = re.search(r"STACK:(\d+)", u)  # ptxas's spills (and local arrays) land on the stack
        print(f"{kind:9s} {M:3d} {c:14s} regs {reg.group(1) if reg else '?':>4s} "
              f"spill {lmem.group(1) if lmem else '?':>5s} shared {r.get('shared')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
