"""Weight-only FP8 linear layers, for FP8 drafts (`eyas.spec.draft_quant`, `--draft-quant fp8`).

At batch 1 a draft level is a chain of GEMVs bound by reading weights. FP8 (e4m3) weights are half the bytes of
bf16. Unlike INT4 they need no groups: one float32 scale per output row keeps every weight within 3 mantissa bits
of its value (relative error <= 2^-4), so the draft's guesses barely move, while the output does not move at all
(the target verifies every guess with the same acceptance rule).

Quantization: scale[n] = max_k |w[n, k]| / 448 (e4m3's largest finite value), q = round_to_e4m3(w / scale[n]),
so w ~= q * scale[n].

Paths:
* CUDA, one or two rows of input without bias (a batch-1 draft level, its head): the register kernel of the one-row
  step (`eyas.kernels.decode_linear` with `scale=`, launched with PDL on sm_90), up to ROW_KERNEL_MAX_ROWS rows (one
  row for a wide model's linears: `Fp8Linear.row_kernel_max_rows`);
* CUDA, up to 16 rows of input (a chain's catch-up): `eyas.kernels.gemv.gemv_triton` with the FP8 codes and the
  scales, streaming the codes;
* anything else (the CPU, more rows, `use_kernel = False`): the reference, the dequantised weight (float32 codes x
  scales, in x's dtype; made once and kept, on CUDA by `prepare` before a CUDA graph captures the forward) through
  F.linear. It is the same weight as the kernel's up to the rounding of q x scale to x's dtype.

Tests: tests/test_fp8.py holds kernel and reference equal.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# rows that take decode_linear's register kernel on CUDA (0: the GEMV always); at 4 rows it lost to the GEMV on the
# H200 (session 25: an 8B draft level 375-465 us against 154, the 8B chain:3 step 5.27 ms against 5.08), and at up
# to 8 on SmolLM2's head (session 43: the default tree's step 1.076-1.079 ms against 1.043-1.052, the real model)
ROW_KERNEL_MAX_ROWS = 2
# ... and at most this many for a wide model's linear (both dimensions over WIDE_DIM: every linear of a Llama has the
# hidden size as one of them, so this is the model's width; an 8B draft's): at 2 rows the register kernel took an 8B
# FP8 draft level's linears ~3x as long as at one (session 44's profile of the 8B `chain:3` step at batch 2: fc 30.7
# us, qkv 24.8, o 21.8, gate/up 116.4, down 59.8, the 32k head 107 against 16.0, 9.9, 10.4, 36.4, 20.3, 33.7 at one
# row), where the GEMV took 3 rows in 14.2, 14.3, 8.8, 43.5, 24.4 and 45.6 (batch 3)
WIDE_ROW_KERNEL_MAX_ROWS = 1
WIDE_DIM = 1024   # eyas.models.one_row.FEW_ROWS_MAX_HIDDEN: SmolLM2's linears (576 on one side) keep 2 rows
# Not kept: the GEMV's launches (more rows than that) as programmatic dependent launches, each program loading its
# first weight chunk before its wait (session 40, 5021ac1). It lost on the H200 in session 42 (one run: the default
# tree's step 1.091 ms against main's 1.058-1.061) and was removed after 8ff1daa.


@torch.no_grad()
def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes float8_e4m3fn [N, K], scale float32 [N]); computed in float32 on the weight's
    device. A zero row gets scale 1 (its codes are zeros)."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 quantization takes a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.contiguous()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: codes [N, K] x scale [N] -> float32 weight [N, K]."""
    return q.float() * scale.float()[:, None]


class Fp8Linear(nn.Module):
    """y = x @ W.T + b with W stored as FP8 codes and a scale per output row (see the module docstring). Built from
    a weight [N, K] (`from_linear` from an nn.Linear); inference only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_fp8(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.use_kernel = True
        self._dense: torch.Tensor | None = None  # the reference path's dequantised weight, made once

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        return cls(linear.weight, linear.bias)

    def dequantized(self) -> torch.Tensor:
        return dequantize_fp8(self.qweight, self.scale)

    def row_kernel_max_rows(self) -> int:
        """The most rows of input that take the register kernel: ROW_KERNEL_MAX_ROWS, or WIDE_ROW_KERNEL_MAX_ROWS for
        a wide model's linear (both dimensions over WIDE_DIM)."""
        wide = min(self.in_features, self.out_features) > WIDE_DIM
        return WIDE_ROW_KERNEL_MAX_ROWS if wide else ROW_KERNEL_MAX_ROWS

    def kernel_ok(self, x2: torch.Tensor) -> bool:
        """Whether the Triton FP8 GEMV runs this call (x2: [M, K]); else the reference."""
        if not (self.use_kernel and x2.is_cuda):
            return False  # (and no Triton import: on the CPU it is a test dependency only)
        from eyas.kernels.gemv import MAX_M
        return x2.shape[0] <= MAX_M and x2.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def _dense_weight(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        d = self._dense
        if d is None or d.device != device or d.dtype != dtype:
            d = self._dense = self.dequantized().to(device=device, dtype=dtype)
        return d

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """Make the reference path's weight now (before a CUDA graph captures a forward that may need it)."""
        self._dense_weight(torch.device(device), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.kernel_ok(x2):
            if bias is None and x2.shape[0] <= self.row_kernel_max_rows():
                from eyas.kernels.decode_linear import decode_linear
                from eyas.models.one_row import use_pdl
                y = decode_linear(x2, self.qweight, scale=self.scale, pdl=use_pdl(x2.device))
            else:
                from eyas.kernels.gemv import gemv_triton
                y = gemv_triton(x2.contiguous(), self.qweight, bias, scale=self.scale)
        else:
            y = F.linear(x2, self._dense_weight(x2.device, x2.dtype), bias)
        return y.view(*shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        self._dense = None  # a move or cast: made again on the next call
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3"
