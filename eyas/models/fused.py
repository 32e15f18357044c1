"""The inference fast path of a loaded model: fused projections and fused Triton kernels (issue #5).

The eager modules launch ~50 small kernels per decoder layer; on a GPU a decode step is bound by their count, not
their work. Three transforms cut it (the third for targets, after the first):

* `fuse_projections(model)`: in every decoder layer, q/k/v become one `qkv_proj` and gate/up one `gate_up_proj`
  (weights and biases concatenated, the originals freed): 5 GEMMs -> 2. It changes the parameters, so it is for
  inference only, after loading and after tensor-parallel sharding (`apply_tensor_parallel` refuses a fused model:
  shard first; the shards of q/k/v and gate/up are then concatenated per rank, which is exactly the rank's share).
  The state-dict names of a fused model are `qkv_proj`/`gate_up_proj`; `hf_state_dict` gives the HF names back
  (`save_draft` uses it). Unfused models keep the HF names.
* `use_fused_ops(model, True)`: the forward carries (hidden, residual) and runs residual add + RMSNorm, RoPE and
  SwiGLU as single Triton kernels (`eyas.kernels.fused_norm`, `fused_rope`, `swiglu`). This needs a device where
  Triton runs (CUDA, or `TRITON_INTERPRET=1`), and is taken only with autograd off (`torch.no_grad` /
  `inference_mode`): a forward with gradients enabled always runs the eager reference, so training is unaffected.

* `fold_norms(model)` (a target, after `fuse_projections`): each decoder layer's RMSNorm weights g are folded into
  the projection that reads the norm, W -> W diag(g) (qkv after the input norm, gate_up after the post-attention
  norm), and the norms keep a unit weight: the same model, every path included (the eager reference, the one-row
  kernels). The fused forward then runs `DecoderLayer.forward_folded`: one residual stream that the o and down
  GEMMs add into (cuBLAS's beta = 1), and the norms' 1/rms applied inside the RoPE + K/V store and SwiGLU
  launches: 8 launches a layer instead of 10 on the steps that do not take the one-row kernels (verify passes,
  batched decoding).

The `ModelRunner` applies them (`enable_fast_path`) to the target and the draft when it uses Triton (on CUDA).
"""
from __future__ import annotations

import torch
from torch import nn

from eyas.models.llama import MLP, Attention, LlamaForCausalLM


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse q/k/v and gate/up of every decoder layer of `model` (LlamaForCausalLM or EagleDraft) in place; returns
    it. Idempotent."""
    for m in list(model.modules()):
        if isinstance(m, (Attention, MLP)):
            m.fuse_projections()
    return model


def is_fused(model: nn.Module) -> bool:
    return any(hasattr(m, "qkv_proj") or hasattr(m, "gate_up_proj") for m in model.modules())


def use_fused_ops(model: nn.Module, on: bool = True) -> nn.Module:
    """Switch the forward of `model` (LlamaForCausalLM or EagleDraft) to the fused Triton kernels, or back."""
    if not hasattr(model, "fused_ops"):
        raise TypeError(f"{type(model).__name__} has no fused path")
    model.fused_ops = bool(on)
    return model


def can_fold_norms(model: nn.Module) -> bool:
    """Whether `fold_norms` applies: a LlamaForCausalLM whose layers have what the one-row kernels need as well
    (`eyas.models.one_row.layer_ready`: fused, plain projections, RMSNorms, no hooks), so that the o and down
    projections can add into the residual stream in their GEMMs (no tensor-parallel hooks)."""
    from eyas.models.one_row import layer_ready
    return isinstance(model, LlamaForCausalLM) and all(layer_ready(layer, True) for layer in model.model.layers)


@torch.no_grad()
def fold_norms(model: nn.Module) -> nn.Module:
    """Fold every decoder layer's RMSNorm weights into the projection after it, in place, and switch the fused
    forward to `DecoderLayer.forward_folded` (module docstring); returns `model`. Idempotent; a model that
    `can_fold_norms` refuses is left as it is. The products g * W are rounded once to the weights' dtype, so outputs
    move by that rounding, not more. Folding a folded model changes nothing (its norm weights are ones)."""
    if not can_fold_norms(model):
        return model
    for layer in model.model.layers:
        for norm, lin in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                          (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
            w = lin.weight
            w.copy_((w.float() * norm.weight.float()[None, :]).to(w.dtype))
            norm.weight.fill_(1.0)
    model.norms_folded = True
    return model


def enable_fast_path(model: nn.Module, one_row: bool = True, few_rows: bool = True,
                     fold: bool = True) -> nn.Module:
    """`fuse_projections` + `use_fused_ops(model, True)` (+ `fold_norms` for a target, with `fold`): what the runner
    does on CUDA. `one_row`: a target (LlamaForCausalLM) also takes `eyas.models.one_row` for batch-1 plain decode
    steps where it can; `few_rows`: for verify passes and plain steps of 2 to 64 tokens (its tile kernels), where
    they pay (small models: `few_rows_pay`); for an EagleDraft, `few_rows` puts its tree levels of 1 to 64 tokens on
    the same kernels (a large draft's of 1 or 2 tokens: `eyas.models.one_row.draft_rows_max`), FP8 drafts too."""
    use_fused_ops(fuse_projections(model), True)
    if fold:
        fold_norms(model)
    elif getattr(model, "norms_folded", False):  # folded earlier: its weights stay folded, and forward_fused with
        model.norms_folded = False  # the unit norm weights computes the same model
    from eyas.models.one_row import draft_rows_max, draft_rows_ready, few_rows_pay, one_row_ready
    if hasattr(model, "one_row"):
        ready = one_row_ready(model)
        model.one_row = one_row and ready
        model.few_rows = few_rows and ready and few_rows_pay(model)
    elif hasattr(model, "few_rows"):  # an EAGLE draft: its tree levels (a large draft's of one or two tokens)
        model.few_rows = few_rows and draft_rows_ready(model)
        model.few_rows_max = draft_rows_max(model)
    return model


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with any fused projection split back into the HF names (q/k/v_proj, gate/up_proj)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if ".qkv_proj." in name:
            prefix, leaf = name.rsplit(".qkv_proj.", 1)
            sizes = model.get_submodule(prefix).qkv_sizes
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split(sizes, dim=0)):
                out[f"{prefix}.{part}.{leaf}"] = piece
        elif ".gate_up_proj." in name:
            prefix, leaf = name.rsplit(".gate_up_proj.", 1)
            gate, up = t.chunk(2, dim=0)
            out[f"{prefix}.gate_proj.{leaf}"], out[f"{prefix}.up_proj.{leaf}"] = gate, up
        else:
            out[name] = t
    return out
