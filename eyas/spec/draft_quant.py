"""Quantized drafts (`--draft-quant`): the draft's weights in INT4 (`eyas.layers.linear_int4`) or FP8
(`eyas.layers.linear_fp8`).

The paper quantizes the draft's FFN to INT4. At small batch a draft level is a chain of GEMVs that read weights; in
an 8B-shaped draft the FFN is 352 MB in bf16 and the LM head it shares with the target 1.05 GB (128k tokens x 4096),
read once per level. Modes:

* `int4-ffn`: each draft decoder layer's gate/up (fused into one `gate_up_proj` first) and down projections become
  `Int4Linear`;
* `int4-head`: the draft scores its candidates with its own INT4 copy of the target's head (of the rows of its draft
  vocabulary, when it has one); the target keeps its bf16 head for verification and for everything else;
* `int4`: both;
* `fp8`: every linear layer of the draft (fc and its decoder layers' attention and FFN projections, fused first) and
  its own copy of the head (of its draft vocabulary's rows, when it has one) as FP8 codes with a scale per output
  row: half the bytes of bf16, read by `eyas.kernels.gemv`'s FP8 path at up to 16 rows on CUDA;
* `fp8-head` (session 34): only the head's copy in FP8, the draft's layers as they are. On SmolLM2 the head (57 MB in
  bf16, a fifth of the target's bytes) is read once per tree level, 14-17 us of a ~55 us level on the H200 (session
  31's profile, docs/benchmarks.md), while the whole FP8 draft made the default tree's step slower (its small
  layers' FP8 GEMVs lose to the tile kernels).
  Its acceptance: MT-Bench TPC 3.852 against 3.826 in bf16 (the default tree, T=0, CPU replay, docs/benchmarks.md
  "Session 34"). On the H200 (session 35, docs/benchmarks.md) the default tree's step is 1.8-2.5% shorter in the
  `smollm2-shape` A/B and 3% on the real model (1.154 against 1.190 ms in one call), `tree:8`'s at batch 8 and 32
  2-3%, so it is the shipped SmolLM2 draft's default on GPUs (below).

The default: with no mode asked (`draft_quant=None`, no `--draft-quant`) a draft gets its own choice for the device
type, config.json `eyas_draft_quant` (SmolLM2's draft: {"cuda": "fp8-head"}), where the device runs it (FP8 needs
sm_89 or later); `none` asks for no quantization whatever the draft's config says (`resolve_draft_quant`). Under
tensor parallelism no default applies (the ranks load the draft as it is; `--draft-quant` is refused there).

Exactness is untouched: the target verifies every guess with the same acceptance rule. Only the acceptance rate can
change, so measure it (`eyas bench tpc --draft-quant int4`) before counting on the bytes saved.
"""
from __future__ import annotations

import torch
from torch import nn

from eyas.layers.linear_fp8 import Fp8Linear
from eyas.layers.linear_int4 import Int4Linear

QUANT_MODES = ("int4", "int4-ffn", "int4-head", "fp8", "fp8-head")
OFF = "none"  # no quantization, whatever the draft's config.json asks


def add_draft_quant_arg(p, help: str | None = None) -> None:
    """`--draft-quant MODE` on an argparse parser (generate, serve, bench tpc/latency, make-tree)."""
    p.add_argument("--draft-quant", default=None, choices=QUANT_MODES + (OFF,),
                   help=(help or "quantize the draft: its FFN and its own copy of the LM head in INT4 (int4), or one "
                                 "of them, or all its weights in FP8 (fp8), or only its head's copy (fp8-head); the "
                                 "target verifies as before, so the output keeps the target's distribution")
                   + f"; {OFF}: no quantization; default: the draft's own choice for the device (the SmolLM2 "
                     "draft's: fp8-head on GPUs with FP8)")


def check_quant_mode(mode: str | None) -> str | None:
    if mode is not None and mode not in QUANT_MODES + (OFF,):
        raise ValueError(f"draft quantization must be one of {', '.join(QUANT_MODES + (OFF,))} (or None: the "
                         f"draft's own choice), got {mode!r}")
    return mode


def asks_quant(mode: str | None) -> bool:
    """Whether `mode` explicitly asks for a quantization (not None, the draft's default, nor "none")."""
    return check_quant_mode(mode) not in (None, OFF)


def resolve_draft_quant(draft, mode: str | None, device) -> str | None:
    """The quantization to apply to `draft` on `device`: `mode` when one is asked; None for "none"; for None the
    draft's own choice for the device type (its config's `draft_quant`, config.json `eyas_draft_quant`, e.g.
    {"cuda": "fp8-head"}) where the device can run it (an FP8 mode needs sm_89 or later on CUDA), else None.
    ValueError: an unknown mode."""
    if check_quant_mode(mode) is not None:
        return None if mode == OFF else mode
    choice = getattr(getattr(draft, "config", None), "draft_quant", None) or {}
    device = torch.device(device)
    auto = choice.get(device.type)
    if auto is not None and auto.startswith("fp8") and device.type == "cuda" \
            and torch.cuda.get_device_capability(device) < (8, 9):
        return None
    return None if check_quant_mode(auto) == OFF else auto


def apply_draft_quant(draft, target, mode: str | None, cuda_kernel: str = "torch"):
    """`quantize_draft` with `mode` resolved on the target's device (`resolve_draft_quant`): as asked, nothing for
    "none", or for None the draft's own choice. What `LLM`, `eyas bench tpc / latency` and `eyas make-tree` apply;
    returns the draft."""
    mode = resolve_draft_quant(draft, mode, next(target.parameters()).device)
    return quantize_draft(draft, target, mode, cuda_kernel=cuda_kernel)


@torch.no_grad()
def quantize_draft(draft, target, mode: str | None, group_size: int = 128, cuda_kernel: str = "torch"):
    """Quantize `draft` (an EagleDraft, loaded; any draft vocabulary already attached) in place as `mode` says;
    returns it. None: unchanged. `cuda_kernel`: "torch" (PyTorch's tinygemm) or "triton" (eyas.kernels.gemv_int4)
    for the INT4 GEMVs on CUDA. ValueError: an unknown mode or kernel, a draft quantized already, or shapes INT4
    cannot take."""
    if cuda_kernel not in ("torch", "triton"):
        raise ValueError(f"the INT4 CUDA kernel must be 'torch' or 'triton', got {cuda_kernel!r}")
    if not asks_quant(mode):  # None or "none" here: a default is resolved first (resolve_draft_quant)
        return draft
    if getattr(draft, "quant", None) is not None:
        raise ValueError(f"this draft is quantized already ({draft.quant})")
    if mode == "fp8" and getattr(draft, "head_norm", None) is not None:
        raise ValueError("--draft-quant fp8: an EAGLE-3 checkpoint's draft takes int4, int4-ffn, int4-head or "
                         "fp8-head (its fc and first layer are not quantized)")
    p = next(draft.parameters())
    if mode in ("int4", "int4-ffn"):
        for layer in draft.layers:
            mlp = layer.mlp
            mlp.fuse_projections()  # one gate_up_proj: what the fast path runs; the HF names are gone
            mlp.gate_up_proj = Int4Linear.from_linear(mlp.gate_up_proj, group_size)
            mlp.down_proj = Int4Linear.from_linear(mlp.down_proj, group_size)
    if mode == "fp8":
        fp8_linears(draft)
    if mode in ("int4", "int4-head", "fp8", "fp8-head"):
        head = getattr(draft, "vocab_head", None)  # the draft vocabulary's rows, or the whole head
        if head is None:
            head = target.lm_head.weight
            if head.shape[0] != target.config.vocab_size:
                raise ValueError("a quantized draft head needs the target's whole LM head on this rank (not "
                                 "vocabulary-parallel)")
        draft.head_quant = Fp8Linear(head) if mode.startswith("fp8") else Int4Linear(head, None, group_size)
    for m in draft.modules():
        if isinstance(m, Int4Linear):
            m.cuda_kernel = cuda_kernel
        if isinstance(m, (Int4Linear, Fp8Linear)):
            m.prepare(p.device, p.dtype)  # packed (INT4) or dequantised (FP8's reference) now, not inside a capture
    draft.quant = mode
    return draft


@torch.no_grad()
def fp8_linears(draft) -> None:
    """`fp8`'s linears, in place: fc and each layer's projections (fused first: qkv_proj, gate_up_proj, what the
    fast path runs) become `Fp8Linear`."""
    draft.fc = Fp8Linear.from_linear(draft.fc)
    for layer in draft.layers:
        for block in (layer.self_attn, layer.mlp):
            block.fuse_projections()
            for name, child in list(block.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(block, name, Fp8Linear.from_linear(child))


def draft_head_logits(draft, h: torch.Tensor) -> torch.Tensor | None:
    """The draft's logits [..., V'] from its quantized head (INT4 or FP8), over the draft vocabulary if one is
    attached, else the whole one; None when the draft has no quantized head (the caller then uses the bf16 head)."""
    qh = getattr(draft, "head_quant", None)
    return None if qh is None else qh(h)  # both layers compute any leading shape as one 2-D product
