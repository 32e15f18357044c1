"""The EAGLE-1 distillation loss.

    loss = w_ce * CE(draft logits, softmax(target logits)) + w_l1 * SmoothL1(draft feature, target feature)

Both terms are averaged over the masked positions: SmoothL1 (beta 1) is first averaged over the hidden dimension,
the cross-entropy is summed over the vocabulary (soft labels from the target), exactly as SafeAILab/EAGLE computes
them. Defaults w_ce = 0.1, w_l1 = 1.0 as in the paper.

`ce_temperature` < 1 sharpens the soft labels: CE against softmax(target logits / ce_temperature), towards the
target's argmax as a hard label as it goes to 0. Greedy (T=0) acceptance needs only the draft's top-1 to agree with
the target's; 1 (the default) is the paper's loss.

`w_hard` > 0 adds that hard label as a term of its own, beside the soft one: w_hard * CE(draft logits, one-hot of the
target's argmax). Run S (docs/draft-training.md) found sharpening (`ce_temperature` 0.25) worth +1.9% of T=0's
`chain:3` but 5.3% of the tree's TPC at T=1, which needs the target's whole distribution; the soft term kept at
temperature 1 might keep the one while the hard term buys the other. Run T measured it (`w_hard` 1.0): `chain:3`
+0.9% over its control, inside the noise, and the tree's T=0 TPC -1.8%; not a default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar, differentiable
    ce: torch.Tensor  # scalar (detached)
    l1: torch.Tensor  # scalar (detached)
    correct: torch.Tensor  # number of masked positions whose draft argmax equals the target's (detached)
    count: torch.Tensor  # number of masked positions


def distill_loss(draft_hidden: torch.Tensor, target_hidden: torch.Tensor, draft_logits: torch.Tensor,
                 target_logits: torch.Tensor, mask: torch.Tensor | None = None, w_ce: float = 0.1,
                 w_l1: float = 1.0, ce_temperature: float = 1.0, w_hard: float = 0.0) -> LossOut:
    """hidden [..., H], logits [..., V], mask [...] (bool or 0/1; None = all positions). Computed in float32."""
    if not ce_temperature > 0:
        raise ValueError(f"ce_temperature must be > 0, got {ce_temperature}")
    if w_hard < 0:
        raise ValueError(f"w_hard must be >= 0, got {w_hard}")
    if mask is None:
        mask = torch.ones(draft_hidden.shape[:-1], device=draft_hidden.device)
    m = mask.to(torch.float32)
    count = m.sum()
    denom = count.clamp(min=1.0)
    l1 = F.smooth_l1_loss(draft_hidden.float(), target_hidden.float(), reduction="none", beta=1.0).mean(-1)
    l1 = (l1 * m).sum() / denom
    p = (target_logits.float() / ce_temperature).softmax(-1)
    logq = draft_logits.float().log_softmax(-1)
    ce = -(p * logq).sum(-1)
    ce = (ce * m).sum() / denom
    loss = w_ce * ce + w_l1 * l1
    if w_hard:
        hard = -logq.gather(-1, target_logits.argmax(-1, keepdim=True)).squeeze(-1)
        loss = loss + w_hard * (hard * m).sum() / denom
    with torch.no_grad():
        correct = ((draft_logits.argmax(-1) == target_logits.argmax(-1)).float() * m).sum()
    return LossOut(loss, ce.detach(), l1.detach(), correct, count)
