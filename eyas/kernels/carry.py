"""Overlapped decoding's input carry in one Triton launch: `eyas.spec.carry.carry_inputs` (its reference) for CUDA.

The reference is ~25 small PyTorch kernels (the slots through the block tables twice, the catch-up tokens, the
masks, a copy per field): in a CUDA graph ~2 us each, a few percent of a small model's step. Here one program per
row does it all: the row's new root, counts, catch-up tokens / positions / slots and commit slots, each looked up
in its block-table row. Padding rows (the scratch slot) are left as they are.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _col(pos, block_size, W):
    """The block-table column of positions (clamped to the table, as `slots_for`)."""
    return tl.minimum(tl.maximum(pos // block_size, 0), W - 1)


@triton.jit
def _carry_kernel(ROOT, NC, ND, COMMIT, CT, CP, CS, CL, SLOT, BT, ACC, PATH, BONUS,
                  scratch, block_size, W, D1, stride_path, stride_acc, stride_bonus,
                  P: tl.constexpr, PP: tl.constexpr, HAS_DRAFT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    live = tl.load(SLOT + b) != scratch
    m = tl.load(ACC + b * stride_acc).to(tl.int64)
    n = tl.load(NC + b)
    j = tl.arange(0, PP)
    jm = j < P
    row = BT + b * W
    live_j = (tl.load(SLOT + b + 0 * j) != scratch) & jm  # the row's liveness per column (a vector mask)
    if HAS_DRAFT:
        # the catch-up pairs at positions n .. n + m: the m accepted tokens (path columns 1..m), then the bonus
        path = tl.load(PATH + b * stride_path + 1 + j, mask=(j < m) & (j < D1 - 1), other=0).to(tl.int64)
        toks = tl.where(j == m, tl.load(BONUS + b * stride_bonus).to(tl.int64), path)
        valid = j <= m
        pos = n + j
        blk = tl.load(row + _col(pos, block_size, W), mask=live_j & valid, other=0)
        slots = tl.where(valid, blk * block_size + pos % block_size, -1)
        keep = live_j
        tl.store(CT + b * P + j, toks, mask=keep)
        tl.store(CP + b * P + j, tl.where(valid, pos, 0), mask=keep)
        tl.store(CS + b * P + j, slots, mask=keep)
        tl.store(CL + b, tl.where(live, m + 1, tl.load(CL + b)))
        tl.store(ND + b, tl.where(live, n, tl.load(ND + b)))
    n_new = n + m + 1
    pos = n_new + j
    blk = tl.load(row + _col(pos, block_size, W), mask=live_j, other=0)
    tl.store(COMMIT + b * P + j, blk * block_size + pos % block_size, mask=live_j)
    tl.store(ROOT + b, tl.where(live, tl.load(BONUS + b * stride_bonus).to(tl.int64), tl.load(ROOT + b)))
    tl.store(NC + b, tl.where(live, n_new, n))


def carry_inputs_triton(inp, out, block_size: int, scratch_slot: int) -> None:
    """`eyas.spec.carry.carry_inputs` in one launch (the same arguments; every input field contiguous int64, as the
    runner's packer lays them out; the outputs may be strided views, as the packed ones are)."""
    B, P = inp.commit_slots.shape
    if B == 0:
        return
    draft = inp.catchup_tokens is not None
    path = out.path_tokens
    fields = [inp.root_tokens, inp.num_cached, inp.num_draft_cached, inp.commit_slots]
    fields += [inp.catchup_tokens, inp.catchup_positions, inp.catchup_slots, inp.catchup_lens] if draft else \
        [inp.commit_slots] * 4  # unused without a draft
    for t in fields + [inp.slots, inp.block_tables]:
        if not t.is_contiguous() or t.dtype.itemsize != 8:
            raise ValueError("carry_inputs_triton needs contiguous int64 input fields")
    _carry_kernel[(B,)](*fields, inp.slots, inp.block_tables, out.num_accepted, path, out.bonus,
                        scratch_slot, block_size, inp.block_tables.shape[1], path.shape[1], path.stride(0),
                        out.num_accepted.stride(0), out.bonus.stride(0),
                        P=P, PP=triton.next_power_of_2(P), HAS_DRAFT=draft, num_warps=1)
