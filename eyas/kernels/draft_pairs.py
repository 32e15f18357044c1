"""The draft's input pairs in one launch: `cat(embed(token), feature)` rows, built by a gather of both.

An EAGLE draft reads `fc(cat(embed(x_{t+1}), h_t))`. At a tree level the tokens are the draft's top-k candidates
(`top[b, parent, rank]`), written to the step's `node_tokens`, and each feature is the parent's. In PyTorch that is
an index and a copy of the tokens, an embedding gather, a gather of the parents' features and a `torch.cat`: five
small kernels at every level, and three for the catch-up pass of the committed pairs. On CUDA one program per
(sequence, row) does them all (`draft_pairs_triton`); `eyas.spec.drafter.draft_pairs_reference` is the same in
PyTorch (it lives there so that the model runs without Triton), and the test (`tests/test_fused_ops.py`) holds the
two equal.

Arguments of both:
* `embed` [V, H]: the (shared) token embedding;
* `tokens` [B, T] and `tok_idx` [Q] (None: 0..Q-1): the row's token is `tokens[b, tok_idx[q]]`;
* `feats` [F, R, H'] and `feat_idx` [Q] (None: 0..Q-1), `feat_rows` [B] (None: b): the row's feature is
  `feats[feat_rows[b], feat_idx[q]]`, cast to the embedding's dtype;
* `tok_out` [B, Q] (any strides, e.g. a column slice of `node_tokens`): receives the tokens, if given;
* `pairs`: whether to build the pairs (the deepest tree level needs its tokens only).
Returns the pairs [B, Q, 2H] in the embedding's dtype, or None when `pairs` is False.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.interpret import gdc_prologue, pdl_on
from eyas.spec.drafter import check_pairs, draft_pairs_reference  # noqa: F401 (the reference, exported beside)

# Programmatic dependent launch (each program lets the next kernel, the draft's fc, launch and load its weights,
# then waits for the top-k before it reads): on since session 40, as `eyas.kernels.chunk_topk.PDL` (its timing there).
PDL = True


@triton.jit
def _draft_pairs_kernel(EMB, TOK, TOK_IDX, FEAT, FEAT_IDX, FEAT_ROWS, OUT, TOK_OUT,
                        Q, H,
                        stride_e, stride_tb, stride_tt, stride_ff, stride_fr, stride_fh,
                        stride_ob, stride_oq, stride_kb, stride_kq,
                        HAS_TOK_IDX: tl.constexpr, HAS_FEAT_IDX: tl.constexpr, HAS_FEAT_ROWS: tl.constexpr,
                        WRITE_TOK: tl.constexpr, WRITE_PAIRS: tl.constexpr, BLOCK_H: tl.constexpr,
                        USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    pid = tl.program_id(0)
    b = (pid // Q).to(tl.int64)
    q = (pid % Q).to(tl.int64)
    t = tl.load(TOK_IDX + q).to(tl.int64) if HAS_TOK_IDX else q
    tok = tl.load(TOK + b * stride_tb + t * stride_tt).to(tl.int64)
    if WRITE_TOK:
        tl.store(TOK_OUT + b * stride_kb + q * stride_kq, tok.to(TOK_OUT.dtype.element_ty))
    if WRITE_PAIRS:
        f = tl.load(FEAT_IDX + q).to(tl.int64) if HAS_FEAT_IDX else q
        fb = tl.load(FEAT_ROWS + b).to(tl.int64) if HAS_FEAT_ROWS else b
        dst = OUT + b * stride_ob + q * stride_oq
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            ok = offs < H
            e = tl.load(EMB + tok * stride_e + offs, mask=ok, other=0.0)
            x = tl.load(FEAT + fb * stride_ff + f * stride_fr + offs * stride_fh, mask=ok, other=0.0)
            tl.store(dst + offs, e.to(OUT.dtype.element_ty), mask=ok)
            tl.store(dst + H + offs, x.to(OUT.dtype.element_ty), mask=ok)


def draft_pairs_triton(embed, tokens, tok_idx=None, feats=None, feat_idx=None, feat_rows=None, tok_out=None,
                       pairs: bool = True):
    """One launch (module docstring)."""
    B, Q = check_pairs(embed, tokens, tok_idx, feats, feat_idx, feat_rows, tok_out, pairs)
    H = embed.shape[1]
    out = torch.empty((B, Q, 2 * H), dtype=embed.dtype, device=tokens.device) if pairs else None
    if B * Q == 0 or (out is None and tok_out is None):
        return out
    dummy = tokens  # any tensor: a pointer the kernel never reads when its flag is off
    f = feats if pairs else embed.view(1, *embed.shape)
    use_gdc, pdl = pdl_on(PDL, tokens.device)
    _draft_pairs_kernel[(B * Q,)](
        embed, tokens, tok_idx if tok_idx is not None else dummy, f,
        feat_idx if feat_idx is not None else dummy, feat_rows if feat_rows is not None else dummy,
        out if out is not None else embed, tok_out if tok_out is not None else tokens,
        Q, H, embed.stride(0), *tokens.stride(), *f.stride(),
        *((out.stride(0), out.stride(1)) if out is not None else (0, 0)),
        *(tok_out.stride() if tok_out is not None else (0, 0)),
        HAS_TOK_IDX=tok_idx is not None, HAS_FEAT_IDX=feat_idx is not None, HAS_FEAT_ROWS=feat_rows is not None,
        WRITE_TOK=tok_out is not None, WRITE_PAIRS=pairs, BLOCK_H=min(1024, triton.next_power_of_2(H)),
        USE_GDC=use_gdc, num_warps=4, **pdl,
    )
    return out
