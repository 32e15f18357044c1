"""Weight-only INT4 linear layers: the paper's INT4 draft FFN (and, here, an INT4 copy of the draft's LM head).

At batch 1 a linear layer is a GEMV bound by reading its weight. Four bits per weight instead of sixteen read a
quarter of the bytes; the draft's guesses may change a little, the output does not, since the target verifies every
guess with the same acceptance rule (speculative decoding stays exact whatever the draft computes).

Quantization: each output row is cut into groups of `group_size` input columns; a group keeps a scale and a zero
and its weights become 4-bit codes q in 0..15:

    w ~= (q - 8) * scale + zero,   scale = (max - min) / 15,   zero = min + 8 * scale

(round to nearest: the error of each weight is at most scale / 2). That is the convention of PyTorch's own int4
kernels (`torch.ops.aten._weight_int4pack_mm`, "tinygemm", which gpt-fast and torchao use), so they run it as it is:

* CUDA: `_weight_int4pack_mm` (bf16 activations: others are cast), weights packed by
  `_convert_weight_to_int4pack`;
* CPU: `_weight_int4pack_mm_for_cpu`, weights packed by `_convert_weight_to_int4pack_for_cpu`;
* reference (any device, dtype or shape the kernels refuse, more than 16 rows on the CPU, and `use_kernel = False`):
  dequantize (once, kept), then x @ W^T.

`cuda_kernel = "triton"` runs eyas's own Triton INT4 GEMV (`eyas/kernels/gemv_int4.py`) instead of tinygemm for up
to 16 rows on CUDA. On the H200 tinygemm is 2.6-7x faster on the 8B shapes (`tools/diag/gemv_int4_bench.py`,
docs/bench/int4_gemv_s12.json), so it stays the default.

The kernels need K (input features) a multiple of 16 * inner_k_tiles (2, 4 or 8) and of the group size (32, 64,
128 or 256), and N (output features) a multiple of 8 (16 on the CPU); `Int4Linear` picks inner_k_tiles and falls
back to the reference where they do not hold. Tests hold kernel and reference equal (tests/test_int4.py; the CUDA
kernel's test runs on the GPU).
"""
from __future__ import annotations

import torch
from torch import nn

GROUP_SIZES = (256, 128, 64, 32)
CPU_KERNEL_MAX_ROWS = 16


def pick_group_size(in_features: int, group_size: int = 128) -> int:
    """`group_size`, or the largest smaller kernel group size that divides `in_features`. ValueError if none does."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"INT4 group size must be one of {GROUP_SIZES}, got {group_size}")
    for g in GROUP_SIZES:
        if g <= group_size and in_features % g == 0:
            return g
    raise ValueError(f"INT4 quantization needs the input features ({in_features}) to be a multiple of 32")


@torch.no_grad()
def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes uint8 [N, K] in 0..15, scales_and_zeros float32 [K / group_size, N, 2]).
    Computed in float32 on the weight's device."""
    if weight.dim() != 2:
        raise ValueError(f"INT4 quantization takes a 2-D weight, got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if K % group_size:
        raise ValueError(f"input features {K} are not a multiple of the group size {group_size}")
    w = weight.detach().float().reshape(N, K // group_size, group_size)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)  # a constant group: any scale > 0 codes it exactly (q = 0)
    zero = lo + 8 * scale
    q = ((w - lo) / scale).round_().clamp_(0, 15).to(torch.uint8).reshape(N, K)
    sz = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
    return q, sz


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The reference: codes [N, K] + scales_and_zeros [K/g, N, 2] -> float32 weight [N, K]."""
    N, K = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, K/g, 2]
    w = (q.float().reshape(N, K // group_size, group_size) - 8) * sz[..., :1] + sz[..., 1:]
    return w.reshape(N, K)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [N, K] -> two per byte, uint8 [N, K/2]: column 2j in the high nibble (the layout
    `_convert_weight_to_int4pack` reads on CUDA, and `eyas.kernels.gemv_int4`)."""
    return (q[:, 0::2] << 4) | q[:, 1::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: uint8 [N, K/2] -> codes uint8 [N, K]."""
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(packed.shape[0], -1)


def _inner_k_tiles(K: int) -> int | None:
    for t in (8, 4, 2):
        if K % (16 * t) == 0:
            return t
    return None


class Int4Linear(nn.Module):
    """y = x @ W.T + b with W stored as 4-bit codes (see the module docstring). Built from a weight [N, K]
    (`from_linear` from an nn.Linear); inference only (no gradients)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 128):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = pick_group_size(self.in_features, group_size)
        q, sz = quantize_int4(weight, self.group_size)
        self.register_buffer("qweight", pack_int4(q))
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.use_kernel = True
        self.cuda_kernel = "torch"  # or "triton": eyas.kernels.gemv_int4 for <= 16 rows (slower on the H200)
        self._packed: tuple | None = None  # (device, packed weight, scales_and_zeros in the kernel's dtype)
        self._dense: torch.Tensor | None = None  # the reference path's dequantised weight, made once

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128) -> "Int4Linear":
        return cls(linear.weight, linear.bias, group_size)

    def codes(self) -> torch.Tensor:
        """The 4-bit codes, uint8 [N, K]."""
        return unpack_int4(self.qweight)

    def dequantized(self) -> torch.Tensor:
        return dequantize_int4(self.codes(), self.scales_and_zeros, self.group_size)

    def _shape_ok(self, device_type: str) -> bool:
        if not self.use_kernel or _inner_k_tiles(self.in_features) is None:
            return False
        if device_type == "cuda":
            return self.out_features % 8 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm")
        if device_type == "cpu":
            return self.out_features % 16 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        return False

    def kernel_ok(self, x: torch.Tensor) -> bool:
        """Whether PyTorch's int4 kernel runs this call (else: the reference). On CUDA it takes bf16 activations;
        float16 and float32 ones are cast (a draft's guesses need no more)."""
        if not self._shape_ok(x.device.type):
            return False
        if x.device.type == "cpu":  # at 256 rows the CPU kernel is ~50x slower than the reference (docs/kernels.md)
            return x.dtype in (torch.float32, torch.bfloat16) and x.numel() // x.shape[-1] <= CPU_KERNEL_MAX_ROWS
        return x.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def _pack(self, device: torch.device, dtype: torch.dtype):
        if self._packed is not None and self._packed[0] == (device, dtype):
            return self._packed[1:]
        tiles = _inner_k_tiles(self.in_features)
        if device.type == "cuda":
            packed = torch.ops.aten._convert_weight_to_int4pack(self.qweight.to(device).contiguous(), tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32), tiles)
        sz = self.scales_and_zeros.to(device=device, dtype=dtype).contiguous()
        self._packed = ((device, dtype), packed, sz)
        return packed, sz

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """Pack the weight for the kernel now (before a CUDA graph captures the forward, so capture allocates
        nothing new)."""
        device = torch.device(device)
        if self._shape_ok(device.type):
            self._pack(device, torch.bfloat16 if device.type == "cuda" else dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernel_ok(x2):
            kdt = torch.bfloat16 if x2.device.type == "cuda" else x2.dtype
            packed, sz = self._pack(x2.device, kdt)
            triton_gemv = x2.device.type == "cuda" and self.cuda_kernel == "triton"
            if triton_gemv:
                from eyas.kernels.gemv_int4 import MAX_M, gemv_int4_triton
                triton_gemv = x2.shape[0] <= MAX_M
            if triton_gemv:  # reads the codes as qweight holds them
                y = gemv_int4_triton(x2.to(kdt).contiguous(), self.qweight, sz, self.group_size).to(x.dtype)
            else:
                op = torch.ops.aten._weight_int4pack_mm if x2.device.type == "cuda" else \
                    torch.ops.aten._weight_int4pack_mm_for_cpu
                y = op(x2.to(kdt).contiguous(), packed, self.group_size, sz).to(x.dtype)
        else:
            d = self._dense
            if d is None or d.device != x2.device or d.dtype != x2.dtype:
                d = self._dense = self.dequantized().to(device=x2.device, dtype=x2.dtype)
            y = x2 @ d.t()
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        self._packed = self._dense = None  # a move or cast: pack again on the next call
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"
