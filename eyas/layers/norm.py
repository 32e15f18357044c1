import torch
from torch import nn


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, in float32 ([...]: the last dim reduced)."""
    return torch.rsqrt(x.float().pow(2).mean(-1) + eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in float32, cast back to x's dtype (no weight: also what EAGLE-3
    style feature layers apply to the target's residual streams)."""
    return (x.float() * rms_scale(x, eps)[..., None]).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps): the normalisation in float32, cast back to x's dtype, then scaled by w (HF
    Llama's order of operations; `eyas.kernels.fused_norm` reproduces it)."""
    return weight * rms_normalize(x, eps)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 as HF Llama does."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
