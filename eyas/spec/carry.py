"""The next decode step's inputs, computed on the device from this step's outputs (overlapped decoding).

With overlap (`EngineConfig.overlap`) the engine enqueues step N+1 of an unchanged batch before it reads step N's
tokens back, so the host's work between steps (reading back, committing, detokenising, scheduling, packing) runs
while the GPU computes, instead of the GPU idling through it. Step N+1's inputs depend on what step N accepted,
which the host does not know yet; `carry_inputs` derives them on the device, in place in the step's input buffers
(`DecodeInputs`, the CUDA graph's static inputs), exactly as the host would pack them after committing step N
(`eyas.engine.runner.ModelRunner.decode_inputs`, the reference: tests/test_overlap.py holds the two equal, and
the one-launch Triton version, `eyas.kernels.carry`, to this one):

    root_tokens       <- bonus                                  (the new last committed token)
    num_draft_cached  <- num_cached                             (with a draft: it reads everything but the root)
    num_cached        <- num_cached + m + 1                     (root and m accepted tokens committed)
    catchup_tokens    <- accepted tokens, then the bonus        (m + 1 pairs for the draft to read)
    catchup_lens, catchup_positions, catchup_slots, commit_slots from the block tables (on the device)

The block tables themselves come from the host (which reserves the blocks two steps ahead before enqueueing a
successor). Padding rows (the scratch slot) stay as packed: nothing cached, scratch block.
"""
from __future__ import annotations

import torch

from eyas.layers.attention import slots_for
from eyas.spec.step import DecodeInputs, DecodeOutputs


def carry_inputs(inp: DecodeInputs, out: DecodeOutputs, block_size: int, scratch_slot: int,
                 use_triton: bool = False) -> None:
    """Overwrite `inp` (step N's inputs) with step N+1's, given step N's outputs `out`; rows whose `slots` is
    `scratch_slot` are padding and keep their values. No host synchronisation, so it can be captured in a CUDA graph.
    `use_triton`: in one launch (`eyas.kernels.carry`); otherwise plain torch, the reference."""
    if use_triton:
        from eyas.kernels.carry import carry_inputs_triton
        carry_inputs_triton(inp, out, block_size, scratch_slot)
        return
    B, P = inp.commit_slots.shape
    live = inp.slots != scratch_slot  # [B]
    m = out.num_accepted.to(torch.long)
    adv = torch.where(live, m + 1, 0)
    n_old = inp.num_cached.clone()
    n_new = n_old + adv
    ar = torch.arange(P, device=n_old.device)[None, :]
    if inp.catchup_tokens is not None:
        # the accepted tokens (path_tokens[:, 1..m]), then the bonus at column m; zeros past it (as packed)
        path = out.path_tokens[:, 1:]
        if path.shape[1] < P:  # a dispatcher's shallower tree: fewer path columns than the buffer's
            path = torch.cat([path, path.new_zeros(B, P - path.shape[1])], dim=1)
        toks = torch.where(ar < m[:, None], path[:, :P], 0)
        toks = torch.where(ar == m[:, None], out.bonus[:, None], toks)
        lens = torch.where(live, m + 1, inp.catchup_lens)
        valid = ar < lens[:, None]
        pos = n_old[:, None] + ar
        inp.catchup_tokens.copy_(torch.where(live[:, None], toks, inp.catchup_tokens))
        inp.catchup_lens.copy_(lens)
        inp.catchup_slots.copy_(torch.where(live[:, None], slots_for(inp.block_tables, pos, valid, block_size),
                                            inp.catchup_slots))
        inp.catchup_positions.copy_(torch.where(live[:, None], torch.where(valid, pos, 0), inp.catchup_positions))
        inp.num_draft_cached.copy_(torch.where(live, n_old, inp.num_draft_cached))
    inp.root_tokens.copy_(torch.where(live, out.bonus, inp.root_tokens))
    inp.num_cached.copy_(n_new)
    commit = slots_for(inp.block_tables, n_new[:, None] + ar, torch.ones_like(ar, dtype=torch.bool), block_size)
    inp.commit_slots.copy_(torch.where(live[:, None], commit, inp.commit_slots))
